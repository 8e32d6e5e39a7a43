"""The rules of Megatron-Bridge's ``ConfigContainer`` for global-batch packing (checked before training).

:func:`check_container` reads a duck-typed container (``cfg.model``, ``cfg.dataset``, ``cfg.train``, ``cfg.ddp``,
``cfg.dist``; every part and attribute may be missing and then takes Megatron's default, :data:`CONFIG_DEFAULTS`)
and applies the model rules of :mod:`mcore_compat.rules.model` to ``cfg.model`` with the container's own. What
depends on the pin comes in as a :class:`PinReading`; :func:`packing.config.validate_global_batch_packing` probes
the pin and writes the defaults.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from mcore_compat.contract.schema import REQUIRED_SAMPLE_KEYS
from mcore_compat.errors import PackingConfigError
from mcore_compat.rules.model import (
    check_cuda_graphs,
    check_dynamic_cp_pool,
    check_hybrid_flag,
    check_micro_batch_size,
    check_min_dynamic_cp_size,
    check_moe_dispatcher,
    check_per_token_loss,
    check_readable,
    check_thd_settings,
    unknown_scheduler,
)
from mcore_compat.rules.values import alignment_multiple, invalid, positive_int, switch_problem

__all__ = [
    "CONFIG_DEFAULTS",
    "LOADER_TYPES",
    "STATIC_CP_SCHEDULER",
    "CheckedContainer",
    "PinReading",
    "check_container",
]


@dataclass(frozen=True)
class PinReading:
    """What the container's rules read from the installed pin: its config fields, its scheduler names and how it
    reads the dynamic-CP switch."""

    config_fields: Sequence[str]
    registered: Sequence[str]
    dynamic_cp_enabled: Callable[[Any], bool]


class CheckedContainer(NamedTuple):
    """A container every rule accepted: the configured scheduler (None: the default), whether dynamic CP is on,
    and the multiple samples are padded to."""

    scheduler: str | None
    dynamic_cp: bool
    pad_to_multiple_of: int


STATIC_CP_SCHEDULER = "dp_balanced"
LOADER_TYPES: tuple[str, ...] = ("single", "cyclic")
CONFIG_DEFAULTS: dict[str, Any] = {
    "model.tensor_model_parallel_size": 1,
    "model.context_parallel_size": 1,
    "model.pipeline_model_parallel_size": 1,
    "model.virtual_pipeline_model_parallel_size": None,
    "model.data_parallel_size": None,
    "model.sequence_parallel": False,
    "model.sequence_packing_scheduler": None,
    "model.dynamic_context_parallel": False,
    "model.min_dynamic_context_parallel_size": 1,
    "model.hybrid_context_parallel": False,
    "model.max_seqlen_per_dp_cp_rank": None,
    "model.seq_length": None,
    "model.calculate_per_token_loss": False,
    "model.cuda_graph_impl": "none",
    "model.vision_cuda_graph_impl": "none",
    "model.enable_cuda_graph": False,
    "model.is_hybrid_model": False,
    "dataset.enable_global_batch_packing": False,
    "dataset.enable_offline_packing": False,
    "dataset.enable_in_batch_packing": False,
    "dataset.packing_buffer_size": None,
    "dataset.dataloader_type": None,
    "dataset.seq_length": None,
    "dataset.yields_unpacked_samples": False,
    "train.micro_batch_size": None,
    "ddp.average_in_collective": False,
    "ddp.use_megatron_fsdp": False,
    "dist.use_decentralized_pg": False,
    "dist.eval_context_parallel_size": None,
    "data_parallel_size": None,
}
_FLAGS = tuple(field for field, default in CONFIG_DEFAULTS.items() if default is False)
_OTHER_PACKING_MODES = (
    ("dataset.enable_offline_packing", "offline", False),
    ("dataset.enable_in_batch_packing", "in-batch", False),
    ("dataset.packing_buffer_size", "Energon", None),
)
_UNSUPPORTED_FEATURES = (
    ("model.virtual_pipeline_model_parallel_size", "virtual pipeline parallelism", None, 1),
    ("model.is_hybrid_model", "Mamba hybrid models", False, None),
    ("ddp.use_megatron_fsdp", "Megatron-FSDP", False, None),
)
"""Per field: the feature it turns on, the value that sets it off, and an int that also means off (one virtual
stage is none; Megatron-Bridge accepts it)."""


class _Layout(NamedTuple):
    tp: int
    cp: int
    pp: int
    dp: int | None


def _get(cfg: Any, field: str) -> Any:
    """``cfg.<part>.<name>`` (or ``cfg.<name>`` for an undotted field), its default where absent."""
    *part, name = field.split(".")
    try:
        owner = getattr(cfg, part[0], None) if part else cfg
        return getattr(owner, name, CONFIG_DEFAULTS[field])
    except Exception as exc:  # noqa: BLE001 - a config's own attribute access (OmegaConf's ??? value), named here
        raise PackingConfigError(
            f"{field} cannot be read ({type(exc).__name__}: {exc}): give {field} a value (None where unused)"
        ) from exc


def _count(cfg: Any, field: str, what: str) -> int | None:
    value = _get(cfg, field)
    return None if value is None else positive_int(field, value, what)


def _check_flags(cfg: Any) -> None:
    """Every on/off field is a bool (or None, unset): ``"false"`` and ``1`` are truthy and would silently switch
    things."""
    for field in _FLAGS:
        value = _get(cfg, field)
        problem = switch_problem(value)
        if problem is not None:
            raise invalid(field, value, problem)


def _check_model(cfg: Any, registered: Sequence[str]) -> None:
    model = getattr(cfg, "model", None)
    if model is None:
        raise PackingConfigError(
            "cfg.model is missing: pass a ConfigContainer-like object with .model and .dataset parts"
        )
    scheduler = _get(cfg, "model.sequence_packing_scheduler")
    problem = unknown_scheduler(scheduler, "model.sequence_packing_scheduler", registered)
    if scheduler is not None and problem is not None:
        raise PackingConfigError(f"{problem}, or leave it None for the default")


def _check_exclusive_modes(cfg: Any) -> None:
    for field, mode, off in _OTHER_PACKING_MODES:
        value = _get(cfg, field)
        if value not in (None, False, 0):
            raise invalid(
                field,
                value,
                f"global-batch packing packs unpacked samples itself and excludes {mode} packing; "
                f"set {field}={off!r} or dataset.enable_global_batch_packing=False",
            )


def _check_dataset(cfg: Any) -> None:
    if _get(cfg, "dataset.yields_unpacked_samples") is not True:
        raise invalid(
            "dataset.yields_unpacked_samples",
            _get(cfg, "dataset.yields_unpacked_samples"),
            f"the scheduler packs unpacked samples, one dict per sequence with keys {list(REQUIRED_SAMPLE_KEYS)}; "
            "use a dataset that yields them (packing.global_batch.build_unpacked_sequence_sample builds one) "
            "and set dataset.yields_unpacked_samples=True",
        )
    loader = _get(cfg, "dataset.dataloader_type")
    if (loader or "single") not in LOADER_TYPES:
        raise invalid(
            "dataset.dataloader_type",
            loader,
            f"samples must arrive one per step, unstacked; set it to one of {list(LOADER_TYPES)}",
        )


def _check_thd_loss_mode(cfg: Any, layout: _Layout) -> None:
    check_micro_batch_size("train.micro_batch_size", _get(cfg, "train.micro_batch_size"))
    check_per_token_loss("model.calculate_per_token_loss", _get(cfg, "model.calculate_per_token_loss"))
    if _get(cfg, "ddp.average_in_collective"):
        raise invalid(
            "ddp.average_in_collective",
            _get(cfg, "ddp.average_in_collective"),
            "per-token loss sums gradients over tokens, not ranks; set ddp.average_in_collective=False",
        )
    check_cuda_graphs(cfg.model, owner="model")
    if layout.pp > 1:
        raise invalid(
            "model.pipeline_model_parallel_size",
            layout.pp,
            "Megatron-Bridge's training loop, whose config this is, does not run global-batch packing with pipeline "
            "parallelism; set model.pipeline_model_parallel_size=1 (a loop of your own may call "
            "wrap_data_iterator_for_global_batch_packing on pipeline stages, with model.variable_seq_lengths=True)",
        )


def _check_unsupported_features(cfg: Any) -> None:
    for field, feature, off, also_off in _UNSUPPORTED_FEATURES:
        value = _get(cfg, field)
        if also_off is not None and type(value) is int and value == also_off:
            continue
        if value is not None and value is not off:  # 0 is not False here: the runtime reads it as set
            raise invalid(field, value, f"global-batch packing does not support {feature}; set {field}={off!r}")


def _layout(cfg: Any) -> _Layout:
    return _Layout(
        tp=_count(cfg, "model.tensor_model_parallel_size", "the tensor-parallel size") or 1,
        cp=_count(cfg, "model.context_parallel_size", "the context-parallel size") or 1,
        pp=_count(cfg, "model.pipeline_model_parallel_size", "the pipeline-parallel size") or 1,
        dp=_data_parallel_size(cfg),
    )


def _data_parallel_size(cfg: Any) -> int | None:
    """``model.data_parallel_size``, else the config container's ``data_parallel_size`` (Megatron-Bridge's
    ``ConfigContainer`` computes it from the world size; a ``TransformerConfig`` has no such field)."""
    what = "world size / (tp * cp * pp)"
    dp = _count(cfg, "model.data_parallel_size", what)
    return dp if dp is not None else _count(cfg, "data_parallel_size", what)


def _dynamic_cp(cfg: Any, pin: PinReading) -> bool:
    check_hybrid_flag(cfg.model, pin.config_fields, owner="model")
    return pin.dynamic_cp_enabled(cfg.model)


def _check_dynamic_cp(cfg: Any, layout: _Layout) -> int:
    """Check D1-D3 and return the DP x CP pool dynamic CP groups are drawn from."""
    if layout.dp is None:
        raise invalid(
            "model.data_parallel_size",
            None,
            "dynamic CP draws its groups from the DP x CP pool; set model.data_parallel_size to "
            "world size / (tp * cp * pp) (or the config container's data_parallel_size, as Megatron-Bridge does)",
        )
    pool = check_dynamic_cp_pool(layout.dp, layout.cp, "model.data_parallel_size")
    minimum = _get(cfg, "model.min_dynamic_context_parallel_size")
    check_min_dynamic_cp_size("model.min_dynamic_context_parallel_size", minimum, pool)
    if _get(cfg, "dist.use_decentralized_pg"):
        raise invalid(
            "dist.use_decentralized_pg",
            _get(cfg, "dist.use_decentralized_pg"),
            "Megatron-Core resolves dynamic CP groups from its global parallel state; "
            "set dist.use_decentralized_pg=False",
        )
    return pool


def _seq_lengths(cfg: Any) -> tuple[int, tuple[str, int]]:
    """Return the model's longest sample and (field, value) of the length samples are cut to."""
    model_seq = _count(cfg, "model.seq_length", "the longest sample in tokens")
    data_seq = _count(cfg, "dataset.seq_length", "the longest sample in tokens")
    if model_seq is None and data_seq is None:
        raise invalid("model.seq_length", None, "set model.seq_length (or dataset.seq_length) to the longest sample")
    if model_seq is not None and data_seq is not None and data_seq > model_seq:
        raise invalid(
            "dataset.seq_length",
            data_seq,
            f"samples would be longer than model.seq_length={model_seq}; lower dataset.seq_length to "
            f"at most {model_seq} or raise model.seq_length",
        )
    if data_seq is None:
        return model_seq, ("model.seq_length", model_seq)  # type: ignore[return-value]
    return model_seq or data_seq, ("dataset.seq_length", data_seq)


def _check_capacity(cfg: Any, pool: int, pool_name: str, seq_length: int) -> None:
    field = "model.max_seqlen_per_dp_cp_rank"
    cap = _get(cfg, field)
    if cap is None:
        raise invalid(
            field,
            None,
            f"set it explicitly to the tokens one rank holds per bin, e.g. seq_length / {pool_name} = "
            f"{math.ceil(seq_length / pool)}",
        )
    positive_int(field, cap, "tokens one rank holds per bin")
    if pool * cap < seq_length:
        raise invalid(
            field,
            cap,
            f"a bin holds {pool_name} ({pool}) x {cap} = {pool * cap} tokens, fewer than seq_length={seq_length}; "
            f"raise it to at least {math.ceil(seq_length / pool)}",
        )


def _alignment(cfg: Any, layout: _Layout, dynamic_cp: bool) -> int:
    """The multiple samples are padded to, once, for training and evaluation; the sample length meets it."""
    pool = _check_dynamic_cp(cfg, layout) if dynamic_cp else layout.cp
    seq_length, (data_field, data_seq) = _seq_lengths(cfg)
    _check_capacity(cfg, pool, "dp x cp" if dynamic_cp else "cp", seq_length)
    eval_cp = _count(cfg, "dist.eval_context_parallel_size", "the context-parallel size of evaluation")
    sequence_parallel = _get(cfg, "model.sequence_parallel") is True
    multiple = math.lcm(
        *(
            alignment_multiple(
                dynamic_cp=dynamic_cp, dp=layout.dp or 1, cp=cp, tp=layout.tp, sequence_parallel=sequence_parallel
            )
            for cp in {layout.cp, eval_cp or layout.cp}
        )
    )
    if data_seq % multiple:
        raise invalid(
            data_field,
            data_seq,
            f"samples are padded to a multiple of {multiple} (the alignment multiple of this parallel layout); "
            f"set {data_field} to a multiple of {multiple}, e.g. {data_seq - data_seq % multiple or multiple}",
        )
    return multiple


def check_container(cfg: Any, pin: PinReading) -> CheckedContainer | None:
    """Check every rule of the container; None when ``dataset.enable_global_batch_packing`` is off (then only a
    stray ``model.sequence_packing_scheduler`` is an error). Raises ``PackingConfigError`` naming the field."""
    scheduler = _get(cfg, "model.sequence_packing_scheduler")
    enabled = _get(cfg, "dataset.enable_global_batch_packing")
    if not isinstance(enabled, bool):
        raise invalid("dataset.enable_global_batch_packing", enabled, "set it to True or False (a bool)")
    if not enabled:
        if scheduler is not None:
            raise invalid(
                "model.sequence_packing_scheduler",
                scheduler,
                "the scheduler is switched on by the dataset; set dataset.enable_global_batch_packing=True "
                "or leave model.sequence_packing_scheduler=None",
            )
        return None
    _check_model(cfg, pin.registered)
    check_readable(cfg.model, owner="model")
    _check_flags(cfg)
    _check_exclusive_modes(cfg)
    _check_dataset(cfg)
    layout = _layout(cfg)
    _check_thd_loss_mode(cfg, layout)
    _check_unsupported_features(cfg)
    check_thd_settings(cfg.model, owner="model")
    check_moe_dispatcher(cfg.model, owner="model")
    dynamic_cp = _dynamic_cp(cfg, pin)
    return CheckedContainer(scheduler, dynamic_cp, _alignment(cfg, layout, dynamic_cp))
