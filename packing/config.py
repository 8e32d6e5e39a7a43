"""Configuration rules of global-batch packing, checked once before training starts.

:func:`validate_global_batch_packing` reads a duck-typed config shaped like Megatron-Bridge's
``ConfigContainer``. Every part and attribute may be missing; a missing one takes Megatron's
default, shown in brackets. Once packing is on, ``cfg.model`` and ``cfg.dataset`` must exist,
because validation writes to them.

``cfg.model`` (TransformerConfig-like)
    ``tensor_model_parallel_size`` [1], ``context_parallel_size`` [1],
    ``pipeline_model_parallel_size`` [1], ``virtual_pipeline_model_parallel_size`` [None],
    ``data_parallel_size`` [None], ``sequence_parallel`` [False], ``sequence_packing_scheduler`` [None],
    ``dynamic_context_parallel`` [False], ``min_dynamic_context_parallel_size`` [1],
    ``hybrid_context_parallel`` [False], ``max_seqlen_per_dp_cp_rank`` [None], ``seq_length`` [None],
    ``calculate_per_token_loss`` [False],
    ``cuda_graph_impl`` ["none"], ``enable_cuda_graph`` [False], ``is_hybrid_model`` [False],
    and where present Megatron-Core's THD options ``thd_max_packed_sequences``, ``pad_packed_seq_alignment``,
    ``thd_tail_padding_policy`` and ``cp_partition_mode`` (the runtime's rules, ``runtime.check_thd_settings``)
``cfg.dataset``
    ``enable_global_batch_packing`` [False], ``enable_offline_packing`` [False],
    ``enable_in_batch_packing`` [False], ``packing_buffer_size`` [None] (Energon),
    ``dataloader_type`` [None, meaning "single"], ``seq_length`` [None], ``yields_unpacked_samples`` [False]
``cfg.train``
    ``micro_batch_size`` [None]
``cfg.ddp``
    ``average_in_collective`` [False], ``use_megatron_fsdp`` [False]
``cfg.dist``
    ``use_decentralized_pg`` [False]

The data-parallel size is read from ``model.data_parallel_size`` (the trainer sets it to
world size / (tp * cp * pp)); only dynamic CP needs it. ``model.seq_length`` (the longest sample the
model takes) falls back to ``dataset.seq_length`` and vice versa; at least one must be set.

When packing is on and every rule holds, validation writes ``model.sequence_packing_scheduler``
(when unset: ``dp_balanced``, or ``default_dynamic_cp`` under dynamic CP; ``balanced`` is opt-in and runs with
static CP on every pin) and
``dataset.global_batch_packing_pad_to_multiple_of``. On a violation it writes nothing and raises
:class:`~packing.types.PackingConfigError` naming the field, its value and the fix, or
:class:`~packing.types.UnsupportedPinError` (the probe's refusal) when the pinned Megatron-Core cannot run
the configured scheduler; both subclass ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import packing as facade
from mcore_compat import adapter, detect, runtime
from mcore_compat.errors import PackingConfigError, UnsupportedPinError
from mcore_compat.portable import SCHEDULERS as PORTABLE_SCHEDULERS
from packing.global_batch import REQUIRED_SAMPLE_KEYS, alignment_multiple

__all__ = [
    "CONFIG_DEFAULTS",
    "LOADER_TYPES",
    "STATIC_CP_SCHEDULER",
    "validate_global_batch_packing",
]

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


def _invalid(field: str, value: Any, fix: str) -> PackingConfigError:
    return PackingConfigError(f"{field}={value!r}: {fix}")


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_int(cfg: Any, field: str, what: str) -> int | None:
    value = _get(cfg, field)
    if value is not None and not _is_positive_int(value):
        raise _invalid(field, value, f"set it to a positive int ({what})")
    return value


def _check_flags(cfg: Any) -> None:
    """Every on/off field must be a bool: ``"false"`` and ``1`` are truthy and would silently switch things."""
    for field in _FLAGS:
        value = _get(cfg, field)
        if not isinstance(value, bool):
            raise _invalid(field, value, f"set it to True or False (a bool: {value!r} is not read as one)")


def _is_power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def _check_model(cfg: Any) -> None:
    model = getattr(cfg, "model", None)
    if model is None:
        raise PackingConfigError(
            "cfg.model is missing: pass a ConfigContainer-like object with .model and .dataset parts"
        )
    scheduler = _get(cfg, "model.sequence_packing_scheduler")
    if scheduler is not None and not isinstance(scheduler, str):
        raise _invalid(
            "model.sequence_packing_scheduler",
            scheduler,
            f"set it to a scheduler name such as {' or '.join(map(repr, PORTABLE_SCHEDULERS))} (static context "
            f"parallelism) or {facade.DYNAMIC_CP_SCHEDULERS[0]!r} (dynamic), or leave it None for the default",
        )


def _check_exclusive_modes(cfg: Any) -> None:
    for field, mode, off in _OTHER_PACKING_MODES:
        value = _get(cfg, field)
        if value not in (None, False, 0):
            raise _invalid(
                field,
                value,
                f"global-batch packing packs unpacked samples itself and excludes {mode} packing; "
                f"set {field}={off!r} or dataset.enable_global_batch_packing=False",
            )


def _check_dataset(cfg: Any) -> None:
    if _get(cfg, "dataset.yields_unpacked_samples") is not True:
        raise _invalid(
            "dataset.yields_unpacked_samples",
            _get(cfg, "dataset.yields_unpacked_samples"),
            f"the scheduler packs unpacked samples, one dict per sequence with keys {list(REQUIRED_SAMPLE_KEYS)}; "
            "use a dataset that yields them (packing.global_batch.build_unpacked_sequence_sample builds one) "
            "and set dataset.yields_unpacked_samples=True",
        )
    loader = _get(cfg, "dataset.dataloader_type")
    if (loader or "single") not in LOADER_TYPES:
        raise _invalid(
            "dataset.dataloader_type",
            loader,
            f"samples must arrive one per step, unstacked; set it to one of {list(LOADER_TYPES)}",
        )


def _check_thd_loss_mode(cfg: Any, layout: _Layout) -> None:
    micro_batch_size = _get(cfg, "train.micro_batch_size")
    if not _is_positive_int(micro_batch_size) or micro_batch_size != 1:
        raise _invalid(
            "train.micro_batch_size",
            micro_batch_size,
            "the scheduler builds each packed microbatch from single samples; set train.micro_batch_size=1",
        )
    if _get(cfg, "model.calculate_per_token_loss") is not True:
        raise _invalid(
            "model.calculate_per_token_loss",
            _get(cfg, "model.calculate_per_token_loss"),
            "packed microbatches hold different token counts; set model.calculate_per_token_loss=True",
        )
    if _get(cfg, "ddp.average_in_collective"):
        raise _invalid(
            "ddp.average_in_collective",
            _get(cfg, "ddp.average_in_collective"),
            "per-token loss sums gradients over tokens, not ranks; set ddp.average_in_collective=False",
        )
    if _get(cfg, "model.enable_cuda_graph"):
        raise _invalid(
            "model.enable_cuda_graph",
            _get(cfg, "model.enable_cuda_graph"),
            "CUDA graphs need static shapes and packed microbatches vary; set model.enable_cuda_graph=False",
        )
    for field in ("model.cuda_graph_impl", "model.vision_cuda_graph_impl"):
        if _get(cfg, field) not in (None, "none"):
            raise _invalid(
                field,
                _get(cfg, field),
                f"CUDA graphs need static shapes and packed microbatches vary; set {field}='none'",
            )
    if layout.pp > 1:
        raise _invalid(
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
            raise _invalid(field, value, f"global-batch packing does not support {feature}; set {field}={off!r}")


def _layout(cfg: Any) -> _Layout:
    return _Layout(
        tp=_positive_int(cfg, "model.tensor_model_parallel_size", "the tensor-parallel size") or 1,
        cp=_positive_int(cfg, "model.context_parallel_size", "the context-parallel size") or 1,
        pp=_positive_int(cfg, "model.pipeline_model_parallel_size", "the pipeline-parallel size") or 1,
        dp=_data_parallel_size(cfg),
    )


def _data_parallel_size(cfg: Any) -> int | None:
    """``model.data_parallel_size``, else the config container's ``data_parallel_size`` (Megatron-Bridge's
    ``ConfigContainer`` computes it from the world size; a ``TransformerConfig`` has no such field)."""
    what = "world size / (tp * cp * pp)"
    dp = _positive_int(cfg, "model.data_parallel_size", what)
    return dp if dp is not None else _positive_int(cfg, "data_parallel_size", what)


def _dynamic_cp(cfg: Any) -> bool:
    value = _get(cfg, "model.dynamic_context_parallel")
    if not isinstance(value, bool):
        raise _invalid("model.dynamic_context_parallel", value, "set it to True or False")
    hybrid = _get(cfg, "model.hybrid_context_parallel")
    if hybrid is True and "dynamic_context_parallel" not in detect().packing_config_fields:
        raise _invalid(
            "model.hybrid_context_parallel",
            hybrid,
            "on this Megatron-Core it diverts every step into its own hybrid-CP schedule, which does not run packed "
            "microbatches; leave it False and set model.dynamic_context_parallel=True (after constructing the "
            "config) for dynamic CP",
        )
    return facade.dynamic_context_parallel_enabled(cfg.model)


def _check_dynamic_cp(cfg: Any, layout: _Layout) -> int:
    """Check D1-D3 and return the DP x CP pool dynamic CP groups are drawn from."""
    if layout.dp is None:
        raise _invalid(
            "model.data_parallel_size",
            None,
            "dynamic CP draws its groups from the DP x CP pool; set model.data_parallel_size to "
            "world size / (tp * cp * pp) (or the config container's data_parallel_size, as Megatron-Bridge does)",
        )
    pool = layout.dp * layout.cp
    if pool < 2 or not _is_power_of_two(pool):
        raise _invalid(
            "model.data_parallel_size",
            layout.dp,
            f"dynamic CP needs the DP x CP pool (data_parallel_size={layout.dp} x context_parallel_size={layout.cp} "
            f"= {pool}) to be a power of two >= 2; change the world size or model.context_parallel_size",
        )
    minimum = _get(cfg, "model.min_dynamic_context_parallel_size")
    if not _is_positive_int(minimum) or not _is_power_of_two(minimum) or minimum > pool:
        raise _invalid(
            "model.min_dynamic_context_parallel_size",
            minimum,
            f"set it to a power of two no larger than the DP x CP pool ({pool}), e.g. 1",
        )
    if _get(cfg, "dist.use_decentralized_pg"):
        raise _invalid(
            "dist.use_decentralized_pg",
            _get(cfg, "dist.use_decentralized_pg"),
            "Megatron-Core resolves dynamic CP groups from its global parallel state; "
            "set dist.use_decentralized_pg=False",
        )
    return pool


def _seq_lengths(cfg: Any) -> tuple[int, tuple[str, int]]:
    """Return the model's longest sample and (field, value) of the length samples are cut to."""
    model_seq = _positive_int(cfg, "model.seq_length", "the longest sample in tokens")
    data_seq = _positive_int(cfg, "dataset.seq_length", "the longest sample in tokens")
    if model_seq is None and data_seq is None:
        raise _invalid("model.seq_length", None, "set model.seq_length (or dataset.seq_length) to the longest sample")
    if model_seq is not None and data_seq is not None and data_seq > model_seq:
        raise _invalid(
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
        raise _invalid(
            field,
            None,
            f"set it explicitly to the tokens one rank holds per bin, e.g. seq_length / {pool_name} = "
            f"{math.ceil(seq_length / pool)}",
        )
    if not _is_positive_int(cap):
        raise _invalid(field, cap, "set it to a positive int (tokens one rank holds per bin)")
    if pool * cap < seq_length:
        raise _invalid(
            field,
            cap,
            f"a bin holds {pool_name} ({pool}) x {cap} = {pool * cap} tokens, fewer than seq_length={seq_length}; "
            f"raise it to at least {math.ceil(seq_length / pool)}",
        )


def validate_global_batch_packing(cfg: Any) -> bool:
    """Check every rule of global-batch packing and apply its defaults; return whether packing is on.

    ``dataset.enable_global_batch_packing`` drives the scheduler: when it is off, only a stray
    ``model.sequence_packing_scheduler`` is an error. The pinned Megatron-Core is probed last.
    ``cfg`` is shaped like Megatron-Bridge's ``ConfigContainer`` (see the module docstring).

    Raises ``PackingConfigError`` for a broken rule and ``UnsupportedPinError`` when the probe refuses.
    """
    scheduler = _get(cfg, "model.sequence_packing_scheduler")
    enabled = _get(cfg, "dataset.enable_global_batch_packing")
    if not isinstance(enabled, bool):
        raise _invalid("dataset.enable_global_batch_packing", enabled, "set it to True or False (a bool)")
    if not enabled:
        if scheduler is not None:
            raise _invalid(
                "model.sequence_packing_scheduler",
                scheduler,
                "the scheduler is switched on by the dataset; set dataset.enable_global_batch_packing=True "
                "or leave model.sequence_packing_scheduler=None",
            )
        return False

    _check_model(cfg)
    runtime.check_readable(cfg.model, owner="model")
    _check_flags(cfg)
    _check_exclusive_modes(cfg)
    _check_dataset(cfg)
    layout = _layout(cfg)
    _check_thd_loss_mode(cfg, layout)
    _check_unsupported_features(cfg)
    runtime.check_thd_settings(cfg.model, owner="model")
    runtime.check_moe_dispatcher(cfg.model, owner="model")
    dynamic_cp = _dynamic_cp(cfg)
    if dynamic_cp:
        pool, pool_name = _check_dynamic_cp(cfg, layout), "dp x cp"
    else:
        pool, pool_name = layout.cp, "cp"
    seq_length, (data_field, data_seq) = _seq_lengths(cfg)
    _check_capacity(cfg, pool, pool_name, seq_length)

    eval_cp = _positive_int(cfg, "dist.eval_context_parallel_size", "the context-parallel size of evaluation")
    sequence_parallel = _get(cfg, "model.sequence_parallel")
    multiple = math.lcm(  # samples are padded once, for training and evaluation
        *(
            alignment_multiple(
                dynamic_cp=dynamic_cp, dp=layout.dp or 1, cp=cp, tp=layout.tp, sequence_parallel=sequence_parallel
            )
            for cp in {layout.cp, eval_cp or layout.cp}
        )
    )
    if data_seq % multiple:
        raise _invalid(
            data_field,
            data_seq,
            f"samples are padded to a multiple of {multiple} (the alignment multiple of this parallel layout); "
            f"set {data_field} to a multiple of {multiple}, e.g. {data_seq - data_seq % multiple or multiple}",
        )

    if scheduler is None:
        scheduler = facade.DYNAMIC_CP_SCHEDULERS[0] if dynamic_cp else STATIC_CP_SCHEDULER
    reason = facade.probe_global_batch_packing_support(scheduler, dynamic_cp=dynamic_cp)
    if reason is not None:
        raise UnsupportedPinError(
            f"model.sequence_packing_scheduler={scheduler!r} cannot run on the pinned Megatron-Core: {reason}"
        )

    refusal = adapter().config_refusal(cfg.model, scheduler)
    if refusal is not None:
        raise UnsupportedPinError(refusal)
    cfg.model.sequence_packing_scheduler = scheduler
    cfg.dataset.global_batch_packing_pad_to_multiple_of = multiple
    return True
