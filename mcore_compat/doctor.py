"""``mcore-compat doctor`` and ``mcore-compat pin status``: what the installed Megatron-Core is and can do.

The doctor answers before a cluster hour is spent: which scheduler and context-parallel mode run on the
installed Megatron-Core and, for each one that does not, why and what to do (one line each). The raw
capability record that detection read stays behind ``--verbose``.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mcore_compat
from mcore_compat.adapters import DYNAMIC_CP_SCHEDULERS, adapter
from mcore_compat.capabilities import Capabilities, detect, shadowed_install
from mcore_compat.pins import Pin, PinTable, load
from mcore_compat.portable import SCHEDULERS as PORTABLE_SCHEDULERS

__all__ = [
    "BASE_SCHEDULERS",
    "format_report",
    "format_status",
    "installed_version",
    "match_installed",
    "pin_name",
    "report",
    "run",
    "status_report",
    "versions",
]

BASE_SCHEDULERS = (*PORTABLE_SCHEDULERS, *DYNAMIC_CP_SCHEDULERS)
MODEL_SUPPORT_CALL = (
    "once packing.enable_dynamic_cp_model_support() has been called (the model then follows each bin's group)"
)
CUSTOM_PIN = "custom"
NO_PIN = "none"


# -- which pin is installed ---------------------------------------------------------------------


def installed_version(caps: Capabilities) -> str | None:
    """The version of the imported Megatron-Core: its distribution's metadata when that distribution is what
    was imported (or when ``megatron.core`` failed to import), else what the module reports (a source tree).
    """
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return caps.mcore_version
    if caps.mcore_path is None:
        return dist.version
    located = Path(str(dist.locate_file("megatron/core"))).resolve()
    return dist.version if located == Path(caps.mcore_path).resolve() else caps.mcore_version


def match_installed(caps: Capabilities, table: PinTable) -> Pin | None:
    """The pin the imported Megatron-Core is, or None."""
    return table.match(installed_version(caps), caps.mcore_commit)


def pin_name(caps: Capabilities, table: PinTable, version: str | None) -> str:
    """The name of the pin installed (``version``: see :func:`installed_version`), ``custom`` or ``none``."""
    pin = table.match(version, caps.mcore_commit)
    if pin is not None:
        return pin.name
    return CUSTOM_PIN if version is not None or caps.mcore_path is not None else NO_PIN


def status_report(caps: Capabilities, table: PinTable, version: str | None) -> dict[str, str | None]:
    """``pin status``: what is installed (``version``: see :func:`installed_version`) and which pin it is."""
    installed = version is not None or caps.mcore_path is not None
    shown = version or ("installed, version unknown" if installed else "not installed")
    if caps.mcore_version and caps.mcore_version != version:
        shown += f" (reports {caps.mcore_version})"
    return {
        "python": f"{sys.executable} ({platform.python_version()})",
        "megatron-core": shown,
        "commit": caps.mcore_commit,
        "path": caps.mcore_path,
        "pin": pin_name(caps, table, version),
        "generation": caps.generation,
        "problem": caps.import_error,
    }


def format_status(status: Mapping[str, str | None]) -> str:
    """``pin status`` as ``key  value`` lines (``-`` for nothing)."""
    width = max(map(len, status))
    return "\n".join(f"{key:<{width}}  {'-' if value is None else value}" for key, value in status.items())


# -- the doctor ---------------------------------------------------------------------------------


def versions(caps: Capabilities) -> dict[str, str | None]:
    """The versions that decide the answer: mcore-compat, Megatron-Core (None: not installed), torch, Python."""
    try:
        import torch

        torch_version: str | None = str(torch.__version__)
    except ImportError:
        torch_version = None
    return {
        "mcore_compat": mcore_compat.__version__,
        "megatron_core": installed_version(caps),
        "torch": torch_version,
        "python": platform.python_version(),
    }


def report() -> dict[str, Any]:
    """Detection, the chosen adapter and the probe answer for every scheduler, with and without dynamic CP."""
    caps = detect()
    chosen = adapter()
    names = sorted(set(BASE_SCHEDULERS) | set(caps.scheduler_names))
    rows: list[dict[str, Any]] = [
        {"scheduler": name, "dynamic_cp": dynamic, "reason": chosen.probe(name, dynamic_cp=dynamic)}
        for name in names
        for dynamic in (False, True)
    ]
    data_probe = getattr(chosen, "data_probe", None)
    for row in rows:
        row["runnable"] = row["reason"] is None
        row["needs_model_support"] = (
            not row["runnable"]
            and row["dynamic_cp"]
            and data_probe is not None
            and data_probe(row["scheduler"], dynamic_cp=True) is None
        )
        runs = row["runnable"] or row["needs_model_support"]
        row["backend"] = chosen.backend_for(row["scheduler"], dynamic_cp=row["dynamic_cp"]) if runs else None
    found = versions(caps)
    return {
        "versions": found,
        "pin": pin_name(caps, load(), found["megatron_core"]),
        "generation": caps.generation,
        "adapter": chosen.name,
        "backend": chosen.backend,
        "capabilities": caps.as_dict(),
        "schedulers": rows,
        "runnable": any(row["runnable"] for row in rows),
        "shadowed_install": _shadowed(),
    }


def _shadowed() -> dict[str, str] | None:
    found = shadowed_install()
    return None if found is None else dict(zip(("version", "path", "imported_from"), found, strict=True))


def _cell(value: Any) -> str:
    if value is None:
        return "(absent)"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple | list):
        return ", ".join(map(str, value)) or "(none)"
    return str(value)


def _mode(row: Mapping[str, Any]) -> str:
    return "dynamic CP" if row["dynamic_cp"] else "static CP"


def _served(data: Mapping[str, Any]) -> str:
    caps = data["capabilities"]
    if caps["import_error"] is not None:
        return f"adapter: {data['adapter']} (no usable Megatron-Core: {caps['import_error']})"
    generation = data["generation"] or "an unknown generation, from its features,"
    commit = f", commit {caps['mcore_commit'][:10]}" if caps["mcore_commit"] else ""
    besides = ""
    other = [row for row in data["schedulers"] if row["backend"] not in (None, data["backend"])]
    if other:
        labels = ", ".join(f"{row['scheduler']} {_mode(row)}" for row in other)
        besides = f" ({labels} on the {', '.join(sorted({row['backend'] for row in other}))} backend)"
    return (
        f"adapter: {data['adapter']} serves {generation} "
        f"(megatron-core {data['versions']['megatron_core']}{commit}) with the {data['backend']} backend{besides}"
    )


def format_report(data: Mapping[str, Any], verbose: bool = False) -> str:
    """The doctor's text: the verdict, one line per scheduler and mode, then where it stands."""
    runs = [row for row in data["schedulers"] if row["runnable"]]
    verdict = "available" if data["runnable"] else "NOT available"
    later = sum(1 for row in data["schedulers"] if row["needs_model_support"])
    more = f"; {later} more once packing.enable_dynamic_cp_model_support() has been called" if later else ""
    lines = [
        f"global-batch packing: {verdict} ({len(runs)} of {len(data['schedulers'])} scheduler/mode pairs run{more})"
    ]
    width = max(len(row["scheduler"]) for row in data["schedulers"])
    for row in sorted(data["schedulers"], key=lambda row: not row["runnable"]):
        mode = _mode(row)
        answer = f"runs ({row['backend']} backend)" if row["runnable"] else f"no: {row['reason']}"
        if row["needs_model_support"]:
            answer = f"runs ({row['backend']} backend) {MODEL_SUPPORT_CALL}"
        lines.append(f"  {row['scheduler']:<{width}}  {mode:<10}  {answer}")
    shadowed = data.get("shadowed_install")
    if shadowed:
        lines.append(
            f"note: megatron.core is imported from {shadowed['imported_from']}, not from the "
            f"installed megatron-core {shadowed['version']} ({shadowed['path']}): PYTHONPATH or a checkout shadows it, "
            "so `mcore-compat pin` changes what is installed, not what is imported"
        )
    found = data["versions"]
    path = data["capabilities"].get("mcore_path")
    mcore = found["megatron_core"] or (f"(version unknown, at {path})" if path else "(absent)")
    lines += [
        "",
        f"Megatron-Core generation: {data['generation'] or 'none'} (pin: {data['pin']})",
        _served(data),
        f"versions: mcore-compat {found['mcore_compat']}, megatron-core {mcore}, "
        f"torch {found['torch'] or '(absent)'}, Python {found['python']}",
    ]
    caps = data["capabilities"]
    if verbose:
        width = max(map(len, caps))
        lines += ["", "capabilities (what detection read; (absent): not found, (none): empty):"]
        lines += [f"  {key:<{width}}  {_cell(value)}" for key, value in caps.items()]
    else:
        lines += ["", "(the capability record detection read: mcore-compat doctor --verbose)"]
    return "\n".join(lines)


def run(as_json: bool, verbose: bool = False) -> int:
    """Print the report; exit status 0 when some scheduler can run, 1 otherwise."""
    data = report()
    print(json.dumps(data, indent=2) if as_json else format_report(data, verbose=verbose))
    return 0 if data["runnable"] else 1
