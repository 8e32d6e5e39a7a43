"""``mcore-compat doctor``: what the pinned Megatron-Core can do, before a cluster hour is spent."""

from __future__ import annotations

import json
from typing import Any

from mcore_compat.adapters import DYNAMIC_CP_SCHEDULERS, adapter
from mcore_compat.capabilities import detect

BASE_SCHEDULERS = ("dp_balanced", *DYNAMIC_CP_SCHEDULERS)
MODEL_SUPPORT_CALL = (
    "once packing.enable_dynamic_cp_model_support() has been called (the model then follows each bin's group)"
)


def report() -> dict[str, Any]:
    """Detection, the chosen adapter and the probe answer for every scheduler, with and without dynamic CP."""
    caps = detect()
    chosen = adapter()
    names = sorted(set(BASE_SCHEDULERS) | set(caps.scheduler_names))
    rows = [
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
    return {
        "generation": caps.generation,
        "adapter": chosen.name,
        "adapter_covers": chosen.covers,
        "backend": chosen.backend,
        "capabilities": caps.as_dict(),
        "schedulers": rows,
        "runnable": any(row["runnable"] for row in rows),
    }


def _cell(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(map(str, value)) or "-"
    return "-" if value is None else str(value)


def format_report(data: dict[str, Any]) -> str:
    """The human-readable doctor table."""
    caps = data["capabilities"]
    lines = [
        f"Megatron-Core generation: {data['generation'] or 'none'}",
        f"adapter: {data['adapter']} ({data['adapter_covers']})",
        "",
        "capabilities:",
    ]
    width = max(map(len, caps))
    lines += [f"  {key:<{width}}  {_cell(value)}" for key, value in caps.items()]
    lines += ["", "schedulers:"]
    for row in data["schedulers"]:
        mode = "dynamic CP" if row["dynamic_cp"] else "static CP"
        verdict = f"runs ({data['backend']} backend)" if row["runnable"] else f"no: {row['reason']}"
        if row.get("needs_model_support"):
            verdict = f"runs (portable backend) {MODEL_SUPPORT_CALL}"
        lines.append(f"  {row['scheduler']:<20} {mode:<10}  {verdict}")
    lines += ["", "global-batch packing: " + ("available" if data["runnable"] else "NOT available")]
    return "\n".join(lines)


def run(as_json: bool) -> int:
    """Print the report; exit status 0 when some scheduler can run, 1 otherwise."""
    data = report()
    print(json.dumps(data, indent=2) if as_json else format_report(data))
    return 0 if data["runnable"] else 1
