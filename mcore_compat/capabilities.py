"""Detect, once, what the installed Megatron-Core offers for global-batch packing.

Detection reads imports, attributes, signatures and dataclass fields; the version string is only
reported, never used to decide anything (dev reports 0.19.0, main 0.20.0).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.metadata
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from mcore_compat.generations import (
    CP_INIT_KEYWORDS,
    DYNAMIC_CP_GROUP_GETTERS,
    FETCH_FUNCTION,
    GENERATIONS,
    PACKING_CONFIG_FIELDS,
    SCHEDULER_MODULE,
    SCHEDULER_UTILS_MODULE,
    WRAP_FUNCTION,
    Generation,
)
from mcore_compat.pins import git_head


@dataclass(frozen=True)
class Capabilities:
    """What the installed Megatron-Core offers, as observed by introspection."""

    mcore_version: str | None
    mcore_commit: str | None
    mcore_path: str | None
    generation: str | None
    import_error: str | None
    scheduler_module: bool
    scheduler_names: tuple[str, ...]
    registry_key: Literal["str", "enum"] | None
    wrap_params: tuple[str, ...] | None
    fetch_params: tuple[str, ...] | None
    fetch_arity: int | None
    dynamic_cp_group_getter: str | None
    has_resolve_cp_group: bool
    has_route_prebuilder: bool
    packed_seq_params_fields: tuple[str, ...]
    init_cp_keywords: tuple[str, ...]
    packing_config_fields: tuple[str, ...]

    @property
    def generation_info(self) -> Generation | None:
        """The facts table entry of the detected generation."""
        return GENERATIONS.get(self.generation) if self.generation else None

    @property
    def mcore_importable(self) -> bool:
        """Whether ``megatron.core`` itself imported."""
        return self.mcore_version is not None and self.generation is not None

    @property
    def has_native_scheduler(self) -> bool:
        """Whether MCore ships ``wrap_data_iterator`` and the packed fetch."""
        return self.wrap_params is not None and self.fetch_params is not None

    def describe(self) -> str:
        """``G8 (megatron-core 0.19.0, commit d48bd6be0a)``-style label for messages."""
        if self.generation is None:
            return "no usable Megatron-Core"
        parts = [f"megatron-core {self.mcore_version}"]
        if self.mcore_commit:
            parts.append(f"commit {self.mcore_commit[:10]}")
        return f"{self.generation} ({', '.join(parts)})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return dataclasses.asdict(self)


def _signature_params(fn: Callable[..., Any] | None) -> tuple[str, ...] | None:
    if fn is None:
        return None
    return tuple(inspect.signature(fn).parameters)


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _describe_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and exc.name == "triton":
        text += " (megatron-core 0.18 and later import triton unconditionally; pip install triton)"
    return text


def _version(core: ModuleType, commit: str | None) -> str:
    info = _import("megatron.core.package_info")
    version = str(getattr(info, "__version__", None) or getattr(core, "__version__", "unknown"))
    # From 0.19 the version appends `git rev-parse HEAD` run next to the module, which for an installed wheel is
    # whatever repository the environment sits in (a venv inside a project): only a checkout's commit is its own.
    return version if commit else version.split("+", 1)[0]


def _commit(core_dir: Path) -> str | None:
    try:
        direct_url = importlib.metadata.distribution("megatron-core").read_text("direct_url.json")
    except importlib.metadata.PackageNotFoundError:
        direct_url = None
    if direct_url:
        commit = json.loads(direct_url).get("vcs_info", {}).get("commit_id")
        if commit:
            return str(commit)
    return git_head(core_dir.parent.parent)


def _scheduler_registry(ds: ModuleType) -> tuple[tuple[str, ...], Literal["str", "enum"] | None]:
    registry = getattr(ds, "scheduler_map", None)
    if registry is None:
        return (), None
    enum_type = getattr(ds, "PackingSchedulerEnum", None)
    names = {key.value if isinstance(key, enum.Enum) else str(key) for key in registry}
    if enum_type is not None:
        names |= {member.value for member in enum_type}
    keyed = "enum" if any(isinstance(key, enum.Enum) for key in registry) else "str"
    return tuple(sorted(names)), keyed


def _dev_generation(
    fetch_params: tuple[str, ...],
    ds: ModuleType,
    utils: ModuleType | None,
    psp_fields: tuple[str, ...],
    has_routes: bool,
) -> str:
    if "dynamic_cp" not in fetch_params:
        return "G3" if hasattr(ds, "DynamicCPDataLoaderWrapper") else "G2"
    if "config" not in fetch_params:
        return "G4" if hasattr(utils, "broadcast_to_pp_group") else "G4b"
    reroute = getattr(utils, "reroute_samples_to_dcp_ranks", None)
    if reroute is not None and len(inspect.signature(reroute).parameters) == 7:
        return "G8"
    if has_routes:
        return "G7"
    if hasattr(_import("megatron.core.packed_seq_params"), "resolve_thd_tail_padding_policy"):
        return "G6b"
    return "G6" if "cp_partition_mode" in psp_fields else "G5"


def _route_prebuilder_module() -> ModuleType | None:
    layout = _import("megatron.core.context_parallel_layout")
    if layout is None or not hasattr(layout, "__path__"):
        return None
    return layout if hasattr(layout, "prebuild_thd_cp_partition_routes") else None


def route_prebuilder() -> Callable[..., None] | None:
    """MCore's ``prebuild_thd_cp_partition_routes``, or None where the pin has no CP-layout routes."""
    layout = _route_prebuilder_module()
    return None if layout is None else layout.prebuild_thd_cp_partition_routes


def _unavailable(import_error: str, version: str | None = None, path: str | None = None) -> Capabilities:
    return Capabilities(
        mcore_version=version,
        mcore_commit=None,
        mcore_path=path,
        generation=None,
        import_error=import_error,
        scheduler_module=False,
        scheduler_names=(),
        registry_key=None,
        wrap_params=None,
        fetch_params=None,
        fetch_arity=None,
        dynamic_cp_group_getter=None,
        has_resolve_cp_group=False,
        has_route_prebuilder=False,
        packed_seq_params_fields=(),
        init_cp_keywords=(),
        packing_config_fields=(),
    )


@functools.cache
def detect() -> Capabilities:
    """Introspect the installed Megatron-Core once; later calls return the cached record."""
    try:
        core = importlib.import_module("megatron.core")
    except ModuleNotFoundError as exc:
        if exc.name in ("megatron", "megatron.core"):
            return _unavailable("megatron-core is not installed")
        return _unavailable(_describe_error(exc))
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return _unavailable(_describe_error(exc))
    core_dir = Path(core.__file__).resolve().parent
    commit = _commit(core_dir)
    version = _version(core, commit)
    try:
        ds: ModuleType | None = importlib.import_module(SCHEDULER_MODULE)
        import_error = None
    except ModuleNotFoundError as exc:
        if exc.name != SCHEDULER_MODULE:
            return _unavailable(_describe_error(exc), version, str(core_dir))
        ds, import_error = None, None
    except Exception as exc:  # noqa: BLE001
        return _unavailable(_describe_error(exc), version, str(core_dir))

    utils = _import(SCHEDULER_UTILS_MODULE)
    psp = importlib.import_module("megatron.core.packed_seq_params")
    psp_fields = tuple(f.name for f in dataclasses.fields(psp.PackedSeqParams))
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    init_params = _signature_params(parallel_state.initialize_model_parallel) or ()
    mpc = importlib.import_module("megatron.core.model_parallel_config").ModelParallelConfig
    has_routes = _route_prebuilder_module() is not None

    wrap_params = _signature_params(getattr(ds, WRAP_FUNCTION, None))
    fetch_params = _signature_params(getattr(ds, FETCH_FUNCTION, None))
    names, keyed = _scheduler_registry(ds) if ds is not None else ((), None)

    if ds is None:
        generation = "G0"
    elif wrap_params is None:
        if fetch_params is not None:
            generation = "M2"
        elif hasattr(utils, "create_data_iterator"):
            generation = "M1"
        else:
            generation = "G1"
    elif keyed == "enum" or hasattr(ds, "PackingSchedulerEnum"):
        generation = "M3"
    else:
        generation = _dev_generation(fetch_params or (), ds, utils, psp_fields, has_routes)

    return Capabilities(
        mcore_version=version,
        mcore_commit=commit,
        mcore_path=str(core_dir),
        generation=generation,
        import_error=import_error,
        scheduler_module=ds is not None,
        scheduler_names=names,
        registry_key=keyed,
        wrap_params=wrap_params,
        fetch_params=fetch_params,
        fetch_arity=GENERATIONS[generation].fetch_arity,
        dynamic_cp_group_getter=next(
            (name for name in DYNAMIC_CP_GROUP_GETTERS if hasattr(parallel_state, name)), None
        ),
        has_resolve_cp_group=hasattr(psp, "resolve_cp_group"),
        has_route_prebuilder=has_routes,
        packed_seq_params_fields=psp_fields,
        init_cp_keywords=tuple(k for k in CP_INIT_KEYWORDS if k in init_params),
        packing_config_fields=tuple(f.name for f in dataclasses.fields(mpc) if f.name in PACKING_CONFIG_FIELDS),
    )


__all__ = [
    "Capabilities",
    "detect",
    "route_prebuilder",
]
