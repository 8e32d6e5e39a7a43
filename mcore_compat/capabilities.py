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
import importlib.util
import inspect
import json
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from mcore_compat.generations import (
    CP_INIT_KEYWORDS,
    DYNAMIC_CP_GROUP_GETTERS,
    FEATURES,
    FETCH_FUNCTION,
    GENERATIONS,
    PACKING_CONFIG_FIELDS,
    PP_BROADCAST_FUNCTION,
    SCHEDULER_MODULE,
    SCHEDULER_UTILS_MODULE,
    WRAP_FUNCTION,
    Generation,
    match,
)
from mcore_compat.gitinfo import archive_commit, git_head
from mcore_compat.import_failure import describe_import_failure

__all__ = [
    "Capabilities",
    "detect",
    "route_prebuilder",
    "shadowed_install",
]


@dataclass(frozen=True)
class Capabilities:
    """What the installed Megatron-Core offers, as observed by introspection."""

    mcore_version: str | None
    mcore_commit: str | None
    mcore_path: str | None
    generation: str | None
    """The generation table row this MCore matches; None when it does not import or matches no row."""
    import_error: str | None
    features: tuple[str, ...]
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
    def facts(self) -> Generation:
        """The matched row; for a shape no row describes, the facts its features imply (feature-first)."""
        return self.generation_info or _inferred(self)

    @property
    def mcore_importable(self) -> bool:
        """Whether ``megatron.core`` and its scheduler module (where it has one) imported."""
        return self.mcore_path is not None and self.import_error is None

    @property
    def unknown_generation(self) -> bool:
        """Megatron-Core imports, but its shape matches no row of the generation table."""
        return self.mcore_importable and self.generation is None

    @property
    def has_native_scheduler(self) -> bool:
        """Whether MCore ships ``wrap_data_iterator`` and the packed fetch."""
        return self.wrap_params is not None and self.fetch_params is not None

    def describe(self) -> str:
        """``G8 (megatron-core 0.19.0, commit <sha>)``-style label for messages."""
        if not self.mcore_importable:
            return "no usable Megatron-Core"
        parts = [f"megatron-core {self.mcore_version}"]
        if self.mcore_commit:
            parts.append(f"commit {self.mcore_commit[:10]}")
        return f"{self.generation or 'unknown generation'} ({', '.join(parts)})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        return dataclasses.asdict(self)


def _inferred(caps: Capabilities) -> Generation:
    """Generation facts read off the features of an MCore that matches no row of the table.

    The rules hold for every row (``tests/test_generations.py``): data on every PP stage once the scheduler
    no longer broadcasts to middle stages; the enum scheduler registry (main) pulls the virtual stage's iterator by
    pipeline stage; the dev schedulers that broadcast to middle stages share packed samples between virtual stages;
    the schedulers that load data on every PP stage also feed every stage holding MTP layers; the dynamic-CP rename
    ends the flag-dispatched hybrid schedule.
    """
    features = frozenset(caps.features)
    keywords = tuple(k for k in ("dynamic_cp", "config") if k in (caps.fetch_params or ()))
    hybrid_only = "hybrid_context_parallel" in caps.packing_config_fields and (
        "dynamic_context_parallel" not in caps.packing_config_fields
    )
    native = caps.has_native_scheduler
    return Generation(
        "unknown",
        "release",
        None,
        "matches no row of the generation table",
        caps.mcore_path or "",
        features,
        frozenset(),
        "",
        fetch_keywords=keywords,
        fetch_arity=None,
        pipeline_data_stages=(
            ("first_last" if "utils.broadcast_to_pp_group" in features else "every") if native else None
        ),
        virtual_stage_source=(
            ("by_pipeline_stage" if "registry.enum" in features else "first_present") if native else None
        ),
        virtual_stages_share_samples=native
        and "utils.broadcast_to_pp_group" in features
        and "registry.enum" not in features,
        feeds_mtp_stages=native and "utils.broadcast_to_pp_group" not in features,
        sample_forms=("unpacked", "packed") if native else None,
        dynamic_cp_group_getter=caps.dynamic_cp_group_getter,
        dynamic_cp_schedulers=tuple(n for n in caps.scheduler_names if n == "default_dynamic_cp")
        if "dynamic_cp" in keywords
        else (),
        schedule_diverts_on="hybrid_context_parallel" if hybrid_only else None,
        bound_cp_group_switches_attention=hybrid_only,
    )


def _signature_params(fn: Callable[..., Any] | None) -> tuple[str, ...] | None:
    if fn is None:
        return None
    return tuple(inspect.signature(fn).parameters)


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _version(core: ModuleType, commit: str | None) -> str:
    info = _import("megatron.core.package_info")
    version = str(getattr(info, "__version__", None) or getattr(core, "__version__", "unknown"))
    # From 0.19 the version appends `git rev-parse HEAD` run next to the module, which for an installed wheel is
    # whatever repository the environment sits in (a venv inside a project): only a checkout's commit is its own.
    return version if commit else version.split("+", 1)[0]


def _installed_core_dir() -> Path | None:
    """Where the installed megatron-core distribution keeps ``megatron/core`` (None: no such distribution)."""
    try:
        dist = importlib.metadata.distribution("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(str(dist.locate_file("megatron/core"))).resolve()


def _located_core() -> str | None:
    """The directory ``megatron.core`` would be imported from, without importing it (None: not found)."""
    try:
        spec = importlib.util.find_spec("megatron.core")
    except Exception:  # noqa: BLE001 - a broken parent package: nothing located
        return None
    if spec is None or not spec.origin:
        return None
    return str(Path(spec.origin).resolve().parent)


def shadowed_install() -> tuple[str, str, str] | None:
    """``(version, installed path, imported path)`` where an installed megatron-core distribution is not what
    ``import megatron.core`` finds (a checkout on ``PYTHONPATH`` shadows it), else None (also for an editable
    install of that checkout)."""
    importlib.invalidate_caches()
    installed, located = _installed_core_dir(), _located_core()
    if installed is None or located is None or not installed.is_dir() or installed == Path(located):
        return None
    return importlib.metadata.version("megatron-core"), str(installed), located


def _commit(core_dir: Path) -> str | None:
    """The commit of the imported Megatron-Core: the installed distribution's when that is what was imported (a git
    install's ``direct_url.json``, or the ``git archive`` tarball it was installed from), else the checkout's
    ``HEAD``."""
    direct_url = None
    if _installed_core_dir() == core_dir:
        direct_url = importlib.metadata.distribution("megatron-core").read_text("direct_url.json")
    if direct_url:
        record = json.loads(direct_url)
        commit = record.get("vcs_info", {}).get("commit_id")
        if commit:
            return str(commit)
        url = urllib.parse.urlparse(record.get("url", ""))
        if "archive_info" in record and url.scheme == "file":
            commit = archive_commit(Path(urllib.request.url2pathname(url.path)))
            if commit:
                return commit
    return git_head(core_dir.parent.parent)


def _scheduler_registry(ds: ModuleType) -> tuple[tuple[str, ...], Literal["str", "enum"] | None]:
    registry = getattr(ds, "scheduler_map", None)
    if registry is None:
        return (), None
    enum_type = getattr(ds, "PackingSchedulerEnum", None)
    names = {key.value if isinstance(key, enum.Enum) else str(key) for key in registry}
    if enum_type is not None:
        names |= {member.value for member in enum_type}
    keyed: Literal["str", "enum"] = "enum" if any(isinstance(key, enum.Enum) for key in registry) else "str"
    return tuple(sorted(names)), keyed


def _features(
    ds: ModuleType | None,
    utils: ModuleType | None,
    psp: ModuleType,
    psp_fields: tuple[str, ...],
    wrap_params: tuple[str, ...] | None,
    fetch_params: tuple[str, ...] | None,
    keyed: str | None,
    has_routes: bool,
) -> frozenset[str]:
    """The generation-table features (``generations.FEATURES``) this Megatron-Core shows."""
    reroute = getattr(utils, "reroute_samples_to_dcp_ranks", None)
    observed = {
        "data_schedule": ds is not None,
        "wrap": wrap_params is not None,
        "fetch": fetch_params is not None,
        "fetch.dynamic_cp": "dynamic_cp" in (fetch_params or ()),
        "fetch.config": "config" in (fetch_params or ()),
        "registry.str": keyed == "str",
        "registry.enum": keyed == "enum" or hasattr(ds, "PackingSchedulerEnum"),
        "DynamicCPDataLoaderWrapper": hasattr(ds, "DynamicCPDataLoaderWrapper"),
        "utils.create_data_iterator": hasattr(utils, "create_data_iterator"),
        "utils.broadcast_to_pp_group": hasattr(utils, PP_BROADCAST_FUNCTION),
        "utils.reroute_all_gather": reroute is not None and len(inspect.signature(reroute).parameters) == 7,
        "psp.cp_partition_mode": "cp_partition_mode" in psp_fields,
        "thd_tail_padding_policy": hasattr(psp, "resolve_thd_tail_padding_policy"),
        "cp_layout_routes": has_routes,
    }
    assert observed.keys() == FEATURES.keys()
    return frozenset(name for name, present in observed.items() if present)


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
        features=(),
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
        return _unavailable(describe_import_failure(exc), path=_located_core())
    except Exception as exc:  # noqa: BLE001 - any import failure is reported, not raised
        return _unavailable(describe_import_failure(exc), path=_located_core())
    core_dir = Path(str(core.__file__)).resolve().parent
    commit = _commit(core_dir)
    version = _version(core, commit)
    try:
        ds: ModuleType | None = importlib.import_module(SCHEDULER_MODULE)
        import_error = None
    except ModuleNotFoundError as exc:
        if exc.name != SCHEDULER_MODULE:
            return _unavailable(describe_import_failure(exc), version, str(core_dir))
        ds, import_error = None, None
    except Exception as exc:  # noqa: BLE001
        return _unavailable(describe_import_failure(exc), version, str(core_dir))

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

    features = _features(ds, utils, psp, psp_fields, wrap_params, fetch_params, keyed, has_routes)
    row = match(features)

    return Capabilities(
        mcore_version=version,
        mcore_commit=commit,
        mcore_path=str(core_dir),
        generation=row.id if row else None,
        import_error=import_error,
        features=tuple(sorted(features)),
        scheduler_module=ds is not None,
        scheduler_names=names,
        registry_key=keyed,
        wrap_params=wrap_params,
        fetch_params=fetch_params,
        fetch_arity=row.fetch_arity if row else None,
        dynamic_cp_group_getter=next(
            (name for name in DYNAMIC_CP_GROUP_GETTERS if hasattr(parallel_state, name)), None
        ),
        has_resolve_cp_group=hasattr(psp, "resolve_cp_group"),
        has_route_prebuilder=has_routes,
        packed_seq_params_fields=psp_fields,
        init_cp_keywords=tuple(k for k in CP_INIT_KEYWORDS if k in init_params),
        packing_config_fields=tuple(f.name for f in dataclasses.fields(mpc) if f.name in PACKING_CONFIG_FIELDS),
    )
