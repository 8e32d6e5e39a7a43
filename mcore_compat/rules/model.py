"""The rules of a model config (Megatron-Core's ``TransformerConfig``), each written once.

A step checks them on every rank before any collective, and :func:`packing.config.validate_global_batch_packing`
applies the same functions to the ``model`` part of Megatron-Bridge's container before training (``owner`` names
the part in messages), so a config that was never validated fails the same way, naming the field, its value and
the fix, instead of running something else (``dynamic_context_parallel="yes"`` running static CP) or failing inside
Megatron-Core. A rank a rule refuses joins the step's agreement with the refusal
(:func:`mcore_compat.agreement.fail_together`), so a value invalid on some ranks only is raised on every rank;
valid settings that differ between ranks are caught there too (:func:`settings_words`).
"""

from __future__ import annotations

import difflib
import enum
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from mcore_compat.contract.schema import Limits
from mcore_compat.errors import PackingConfigError
from mcore_compat.generations import PACKING_CONFIG_FIELDS, PACKING_MOE_DISPATCHERS
from mcore_compat.problems import NOT_AN_INT, SETTINGS_FIELDS
from mcore_compat.rules.values import alignment_multiple, invalid, is_positive_int, is_power_of_two, switch_problem
from mcore_compat.schedulers import SCHEDULER_NAMES

__all__ = [
    "CP_PARTITION_MODES",
    "PG_GROUPS",
    "STEP_FIELDS",
    "SWITCHES",
    "THD_TAIL_POLICIES",
    "check_config_object",
    "check_cuda_graphs",
    "check_dynamic_cp_pool",
    "check_fetch_config",
    "check_hybrid_flag",
    "check_micro_batch_size",
    "check_min_dynamic_cp_size",
    "check_moe_dispatcher",
    "check_per_token_loss",
    "check_pipeline_shapes",
    "check_portable_dynamic_cp",
    "check_readable",
    "check_settings",
    "check_switches",
    "check_thd_settings",
    "check_virtual_stages",
    "dynamic_cp_switch",
    "max_seqlen_per_dp_cp_rank",
    "probe_arguments",
    "require_fields",
    "invalid_groups",
    "require_groups",
    "require_pg_collection",
    "scheduler_name",
    "scheduler_value",
    "settings_words",
    "standalone_mtp_stages",
    "unknown_scheduler",
    "step_limits",
    "virtual_stages",
]


THD_TAIL_POLICIES = ("append_dummy_seq", "extend_last")
"""Values of ``thd_tail_padding_policy`` besides None (which means ``append_dummy_seq``)."""
CP_PARTITION_MODES = ("zigzag", "contiguous")
"""Values of ``cp_partition_mode`` (absent means ``zigzag``)."""


def scheduler_value(value: Any) -> Any:
    """An enum member with a string value (``PackingSchedulerEnum.DP_BALANCED``) as that string; else ``value``."""
    return value.value if isinstance(value, enum.Enum) and isinstance(value.value, str) else value


def unknown_scheduler(
    value: Any, field: str = "sequence_packing_scheduler", registered: Sequence[str] = ()
) -> str | None:
    """Why ``value`` is not a scheduler name (not a string, or a typo: with the close spelling), or None.

    The names are :data:`SCHEDULER_NAMES` and any other the pin's own registry holds (``registered``).
    """
    if not isinstance(value, str):
        return (
            f"{field}={value!r} is not a scheduler name; pass a string such as 'dp_balanced' (or "
            "'default_dynamic_cp' with dynamic context parallelism)"
        )
    known = tuple(dict.fromkeys((*SCHEDULER_NAMES, *registered)))
    if value in known:
        return None
    folded = {name.lower(): name for name in known}
    close = [folded[value.lower()]] if value.lower() in folded else difflib.get_close_matches(value, known, 1)
    spelling = f"did you mean {close[0]!r}? " if close else ""
    return f"{field}={value!r} is not a scheduler name; {spelling}known names: {', '.join(known)} (exact spelling)"


def scheduler_name(model_config: Any, owner: str = "model_config", registered: Sequence[str] = ()) -> str:
    """The configured scheduler as an exact string (an enum member is written back as its string value), one of
    :data:`SCHEDULER_NAMES` or ``registered``."""
    configured = getattr(model_config, "sequence_packing_scheduler", None)
    value = scheduler_value(configured)
    if value is not configured:
        model_config.sequence_packing_scheduler = value
    problem = unknown_scheduler(value, f"{owner}.sequence_packing_scheduler", registered)
    if problem is not None:
        raise PackingConfigError(problem)
    return str(value)


def probe_arguments(scheduler: Any, dynamic_cp: Any) -> tuple[str, bool] | str:
    """The probe's arguments as a scheduler name and a switch (a ``str`` enum member gives its value), or why
    they are neither: the probe answers for them as the runtime would read the config fields they stand for."""
    scheduler = scheduler_value(scheduler)
    if not isinstance(scheduler, str):
        return str(unknown_scheduler(scheduler))
    if not isinstance(dynamic_cp, bool):
        return (
            f"dynamic_cp={dynamic_cp!r} is not a switch; pass True or False (a bool, as "
            "model_config.dynamic_context_parallel must be: values such as 1 or 'yes' are refused at run time)"
        )
    return scheduler, dynamic_cp


SWITCHES = (
    "dynamic_context_parallel",
    "hybrid_context_parallel",
    "sequence_parallel",
    "pad_packed_seq_by_appending_dummy_seq",
)
"""Config switches a packing step reads (``hybrid_context_parallel`` is the deprecated name of the first)."""


def check_switches(model_config: Any, owner: str = "model_config") -> None:
    """Each of :data:`SWITCHES` is True, False or unset (None): a string such as ``'False'`` would read as on."""
    for name in SWITCHES:
        value = getattr(model_config, name, None)
        problem = switch_problem(value)
        if problem is not None:
            raise invalid(f"{owner}.{name}", value, problem)


def check_dynamic_cp_pool(dp: int, cp: int, field: str = "pg_collection.dp_cp.size()") -> int:
    """The DP x CP pool dynamic CP forms its groups from: a power of two >= 2 (the schedulers size groups in powers
    of two up to the pool; Megatron-Core's own groups at another pool lack some of them). Returns its size.

    ``field`` names where the size was read: the pool itself, or the data-parallel size it comes from.
    """
    pool = dp * cp
    if pool < 2 or not is_power_of_two(pool):
        raise invalid(
            field,
            dp if field.endswith("data_parallel_size") else pool,
            f"dynamic CP needs the DP x CP pool (data-parallel {dp} x context-parallel {cp} = {pool}) to be a power "
            "of two >= 2; change the world size or context_parallel_size",
        )
    return pool


def check_min_dynamic_cp_size(field: str, value: Any, pool: int | None) -> int:
    """``min_dynamic_context_parallel_size`` (``field`` names where it was given): a power of two no larger than the
    DP x CP pool (so it divides it), where the pool is known."""
    if not is_power_of_two(value) or (pool is not None and value > pool):
        pool_size = f" ({pool})" if pool is not None else ""
        raise invalid(field, value, f"set it to a power of two no larger than the DP x CP pool{pool_size}, e.g. 1")
    return int(value)


def max_seqlen_per_dp_cp_rank(model_config: Any) -> int:
    """The bin capacity per DP x CP rank: a positive int."""
    capacity: Any = getattr(model_config, "max_seqlen_per_dp_cp_rank", None)
    if not is_positive_int(capacity):
        raise PackingConfigError(
            f"model_config.max_seqlen_per_dp_cp_rank={capacity!r}: set it to a positive int, the number of padded "
            "tokens one DP x CP rank holds per microbatch (bins hold that times the CP size, or the DP x CP pool "
            "under dynamic CP)"
        )
    return int(capacity)


def check_thd_settings(model_config: Any, owner: str = "model_config") -> None:
    """Megatron-Core's THD options, where the config has them, hold values its scheduler and fetch accept.

    Dev pins read ``thd_max_packed_sequences`` when scheduling and ``pad_packed_seq_alignment``,
    ``thd_tail_padding_policy`` and ``cp_partition_mode`` in the packed fetch, where a bad value is a raw
    error deep in the step (the portable backend refuses THD padding outright). Messages name each field
    as ``{owner}.{field}`` (validation passes ``"model"``).
    """
    max_seqs = getattr(model_config, "thd_max_packed_sequences", None)
    if max_seqs is not None and not is_positive_int(max_seqs):
        raise PackingConfigError(
            f"{owner}.thd_max_packed_sequences={max_seqs!r}: set it to None or a positive int, the most "
            "sequences one packed microbatch holds"
        )
    alignment = getattr(model_config, "pad_packed_seq_alignment", None)
    if (
        alignment is not None
        and not (isinstance(alignment, str) and alignment == "max")
        and not is_positive_int(alignment)
    ):
        raise PackingConfigError(
            f"{owner}.pad_packed_seq_alignment={alignment!r}: set it to None, a positive int (pad each packed "
            "microbatch to a multiple of it) or 'max' (pad it to max_seqlen_per_dp_cp_rank)"
        )
    policy = getattr(model_config, "thd_tail_padding_policy", None)
    if policy is not None and not (isinstance(policy, str) and policy in THD_TAIL_POLICIES):
        raise PackingConfigError(
            f"{owner}.thd_tail_padding_policy={policy!r}: set it to None, {' or '.join(map(repr, THD_TAIL_POLICIES))}"
        )
    if hasattr(model_config, "cp_partition_mode"):
        mode = model_config.cp_partition_mode
        if not (isinstance(mode, str) and mode in CP_PARTITION_MODES):
            raise PackingConfigError(
                f"{owner}.cp_partition_mode={mode!r}: set it to {' or '.join(map(repr, CP_PARTITION_MODES))} "
                "(zigzag is the default)"
            )
    if alignment is not None and (policy or THD_TAIL_POLICIES[0]) == THD_TAIL_POLICIES[0] and max_seqs == 1:
        raise PackingConfigError(
            f"{owner}.thd_max_packed_sequences=1 with pad_packed_seq_alignment={alignment!r}: the padding tail "
            "is appended as a dummy sequence, which takes one of the slots; set thd_max_packed_sequences to 2 or "
            "more (or thd_tail_padding_policy='extend_last')"
        )


def check_virtual_stages(model_config: Any, *, dynamic_cp: bool = False, stages_run: bool = True) -> None:
    """``virtual_pipeline_model_parallel_size`` is None or a positive int (1 where the backend runs no virtual
    stages: ``stages_run`` False) and, when it is set, ``microbatch_group_size_per_vp_stage`` (which Megatron-Core's
    scheduler then reads) is None or a positive int, None or 1 under dynamic CP.

    Megatron-Core takes 0 or a bool for one stage and fails on a float or a string inside the step; its dynamic-CP
    scheduler aligns its group count to the microbatch group whenever virtual stages are set at all, even to 1, and
    fails an assertion in a step whose groups cannot be split that far.
    """
    stages = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    if stages is None:
        return
    field = "model_config.virtual_pipeline_model_parallel_size"
    if not is_positive_int(stages):
        raise invalid(
            field,
            stages,
            "set it to None (no virtual pipeline stages) or a positive int, the number of virtual stages per pipeline "
            "rank",
        )
    if not stages_run and stages != 1:
        raise invalid(
            field, stages, "dynamic context parallelism runs without virtual pipeline parallelism here; set it to None"
        )
    group = getattr(model_config, "microbatch_group_size_per_vp_stage", None)
    if group is not None and not is_positive_int(group):
        raise invalid(
            "model_config.microbatch_group_size_per_vp_stage",
            group,
            f"with virtual_pipeline_model_parallel_size={stages}: set it to None or a positive int (Megatron-Core "
            "defaults it to the pipeline-parallel size)",
        )
    if dynamic_cp and group not in (None, 1):
        raise invalid(
            "model_config.microbatch_group_size_per_vp_stage",
            group,
            "with dynamic context parallelism it groups microbatches for virtual pipeline stages, which dynamic CP "
            "runs without, yet Megatron-Core's dynamic-CP scheduler aligns to it and fails for steps it cannot "
            "split; set it to None or 1 (or virtual_pipeline_model_parallel_size=None)",
        )


def check_per_token_loss(field: str, value: Any) -> None:
    """Packed microbatches hold different token counts: the loss is summed per token (``calculate_per_token_loss``)."""
    if value is not True:
        raise invalid(field, value, f"packed microbatches hold different token counts; set {field}=True")


def check_micro_batch_size(field: str, value: Any) -> None:
    """Each packed microbatch is built from single samples: a micro-batch size of 1."""
    if not (is_positive_int(value) and value == 1):
        raise invalid(field, value, f"each packed microbatch is built from single samples; set {field}=1")


def check_cuda_graphs(model_config: Any, owner: str = "model_config") -> None:
    """No CUDA graphs (``enable_cuda_graph``, ``cuda_graph_impl``, ``vision_cuda_graph_impl``): they need one
    static shape and packed microbatches vary in length."""
    fix = "CUDA graphs need static shapes and packed microbatches vary"
    enabled = getattr(model_config, "enable_cuda_graph", False)
    if enabled not in (None, False):
        raise invalid(f"{owner}.enable_cuda_graph", enabled, f"{fix}; set {owner}.enable_cuda_graph=False")
    for name in ("cuda_graph_impl", "vision_cuda_graph_impl"):
        impl = getattr(model_config, name, "none")
        if impl not in (None, "none"):
            raise invalid(f"{owner}.{name}", impl, f"{fix}; set {owner}.{name}='none'")


def check_hybrid_flag(model_config: Any, config_fields: Sequence[str], owner: str = "model_config") -> None:
    """``hybrid_context_parallel`` stays off where it is not an alias of ``dynamic_context_parallel`` (pins whose
    config lacks that field: there it diverts every step into Megatron-Core's own hybrid-CP schedule)."""
    value = getattr(model_config, "hybrid_context_parallel", None)
    if value is True and "dynamic_context_parallel" not in config_fields:
        raise invalid(
            f"{owner}.hybrid_context_parallel",
            value,
            "on this Megatron-Core it makes forward_backward_no_pipelining divert every step into its own hybrid-CP "
            "schedule, which does not run packed microbatches; leave it False and set "
            f"{owner}.dynamic_context_parallel=True (after constructing the config) for dynamic CP",
        )


def check_portable_dynamic_cp(model_config: Any, pipeline_stages: int, config_fields: Sequence[str]) -> None:
    """What the portable backend's dynamic CP runs with: one pipeline stage and no virtual stages, per-token loss,
    micro-batch size 1, no CUDA graphs, and ``hybrid_context_parallel`` off where it is not an alias. Attributes the
    config does not have are not checked."""
    if pipeline_stages > 1:
        raise invalid(
            "pipeline_model_parallel_size",
            pipeline_stages,
            "dynamic context parallelism runs without pipeline parallelism on the portable backend; set it to 1",
        )
    check_virtual_stages(model_config, dynamic_cp=True, stages_run=False)
    check_per_token_loss(
        "model_config.calculate_per_token_loss", getattr(model_config, "calculate_per_token_loss", True)
    )
    check_micro_batch_size("model_config.micro_batch_size", getattr(model_config, "micro_batch_size", 1))
    check_cuda_graphs(model_config)
    check_hybrid_flag(model_config, config_fields)


def check_pipeline_shapes(model_config: Any, pipeline_stages: int) -> None:
    """With several pipeline stages, ``variable_seq_lengths`` is True.

    Packed microbatches vary in length; Megatron-Core's pipeline schedule sends each stage's activations
    with their shape ahead of them only when ``variable_seq_lengths`` is set, else the next stage receives
    into a buffer of the fixed ``seq_length`` shape. Dev's ``TransformerConfig`` sets it whenever a
    ``sequence_packing_scheduler`` is given to its constructor; set after construction (and on pins
    without that field) it stays False.
    """
    value = getattr(model_config, "variable_seq_lengths", None)
    if pipeline_stages > 1 and value is not True:
        raise PackingConfigError(
            f"model_config.variable_seq_lengths={value!r} with {pipeline_stages} pipeline stages: packed "
            "microbatches vary in length, and Megatron-Core's pipeline schedule sends activations in the fixed "
            "seq_length shape unless it is True (the next stage would receive a tensor of another size); set "
            "model_config.variable_seq_lengths=True"
        )


def virtual_stages(model_config: Any) -> int | None:
    """The number of virtual pipeline stages per pipeline rank when there are several, else None
    (after :func:`check_virtual_stages`)."""
    stages: Any = getattr(model_config, "virtual_pipeline_model_parallel_size", None)
    return int(stages) if is_positive_int(stages) and stages > 1 else None


def standalone_mtp_stages(model_config: Any) -> frozenset[tuple[int, int]]:
    """The ``(pipeline rank, virtual stage)`` pairs holding multi-token-prediction layers other than the last
    virtual stage of the last pipeline rank (Megatron-Core's "standalone" MTP), read from
    ``model_config.pipeline_model_parallel_layout``; empty without a layout (MTP then sits on the last stage)."""
    ranks = getattr(getattr(model_config, "pipeline_model_parallel_layout", None), "layout", None)
    if not isinstance(ranks, list | tuple) or not ranks:
        return frozenset()
    last = (len(ranks) - 1, len(ranks[-1]) - 1)
    return frozenset(
        (pp_rank, vp_stage)
        for pp_rank, stages in enumerate(ranks)
        for vp_stage, layers in enumerate(stages)
        if (pp_rank, vp_stage) != last and any(getattr(layer, "name", layer) == "mtp" for layer in layers)
    )


STEP_FIELDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        (
            *SETTINGS_FIELDS,
            *PACKING_CONFIG_FIELDS,
            "pipeline_model_parallel_layout",
            "mtp_num_layers",
            "variable_seq_lengths",
            "context_parallel_size",
            "calculate_per_token_loss",
            "micro_batch_size",
            "cuda_graph_impl",
            "enable_cuda_graph",
            "multi_latent_attention",
            "num_moe_experts",
            "moe_token_dispatcher_type",
            "tensor_model_parallel_size",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
            "is_hybrid_model",
            "experimental_attention_variant",
            "vision_cuda_graph_impl",
        )
    )
)
"""Every model-config field a packing step reads (its wrap and fetches; the facade's and, from the generation table,
every generation's scheduler's; under dynamic CP also the fields that name the model's parts)."""


def check_readable(model_config: Any, owner: str = "model_config") -> None:
    """Each field of :data:`STEP_FIELDS` reads without raising (absent is fine), or raise naming the first that
    raises (as OmegaConf raises ``MissingMandatoryValue`` for a value left ``???``)."""
    for name in STEP_FIELDS:
        try:
            getattr(model_config, name, None)
        except Exception as exc:  # noqa: BLE001 - any error of the config's own attribute access, named here
            raise PackingConfigError(
                f"{owner}.{name} cannot be read ({type(exc).__name__}: {exc}): a packing step reads it on every "
                f"rank; give {owner}.{name} a value (None where unused)"
            ) from exc


def check_config_object(model_config: Any) -> None:
    """The settings are attributes of one config object: not None, not a plain mapping (a dict read from YAML),
    and each field of :data:`STEP_FIELDS` reads without raising (:func:`check_readable`).

    A mapping that also answers attributes (OmegaConf's ``DictConfig``, an attribute dict) is a config object.
    Called before anything else reads the config, so a field that raises is refused on every rank together.
    """
    if model_config is None:
        raise PackingConfigError(
            "model_config=None: a packing step reads its settings as attributes of the model's config; pass the "
            "TransformerConfig the model was built with"
        )
    check_readable(model_config)
    if isinstance(model_config, Mapping) and not hasattr(model_config, "sequence_packing_scheduler"):
        raise PackingConfigError(
            f"model_config is a mapping ({type(model_config).__name__}): a packing step reads its settings as "
            "attributes (model_config.sequence_packing_scheduler, ...), not keys; pass the TransformerConfig the model "
            "was built with (or types.SimpleNamespace(**settings))"
        )


_last_fetch_config: list[Any] = [None]
"""The config object the last fetch accepted (a strong reference: configs need not support weak ones)."""


def check_fetch_config(model_config: Any) -> None:
    """:func:`check_config_object` for a fetch, skipped for the object the last fetch accepted: every microbatch of
    a step is fetched with the step's config, which ``wrap`` checked in full."""
    if model_config is not None and model_config is _last_fetch_config[0]:
        return
    check_config_object(model_config)
    _last_fetch_config[0] = model_config


def check_moe_dispatcher(model_config: Any, owner: str = "model_config") -> None:
    """MoE layers dispatch tokens with one of :data:`~mcore_compat.generations.PACKING_MOE_DISPATCHERS` where their
    gather spans DP ranks (expert parallelism, or an expert TP group wider than TP); one TP group alone holds
    equal token counts, so the ``allgather`` default stays accepted there. Messages name ``{owner}.{field}``."""
    experts = getattr(model_config, "num_moe_experts", None)
    dispatcher = getattr(model_config, "moe_token_dispatcher_type", None)
    if not experts or not isinstance(dispatcher, str) or dispatcher in PACKING_MOE_DISPATCHERS:
        return
    tp: Any = getattr(model_config, "tensor_model_parallel_size", 1)
    ep: Any = getattr(model_config, "expert_model_parallel_size", 1)
    etp: Any = getattr(model_config, "expert_tensor_parallel_size", None)
    if (is_positive_int(ep) and ep > 1) or (is_positive_int(etp) and is_positive_int(tp) and etp > tp):
        raise PackingConfigError(
            f"{owner}.moe_token_dispatcher_type={dispatcher!r} with num_moe_experts={experts!r}, "
            f"expert_model_parallel_size={ep!r} and expert_tensor_parallel_size={etp!r}: it gathers equal token "
            "counts over ranks of different DP ranks, which run packed bins of different lengths (Megatron-Core "
            f"refuses it with a packing scheduler); set {owner}.moe_token_dispatcher_type='alltoall' (or 'flex')"
        )


def dynamic_cp_switch(model_config: Any, config_fields: Sequence[str]) -> bool:
    """Whether the config turns dynamic CP on: an explicit True, or Megatron-Core's deprecated
    ``hybrid_context_parallel`` alias where the pin's config has both fields (``config_fields``)."""
    if getattr(model_config, "dynamic_context_parallel", None) is True:
        return True
    has_alias = "dynamic_context_parallel" in config_fields and "hybrid_context_parallel" in config_fields
    return has_alias and getattr(model_config, "hybrid_context_parallel", None) is True


def check_settings(
    model_config: Any, pg_collection: Any, config_fields: Sequence[str] = (), registered: Sequence[str] = ()
) -> bool:
    """Every rule of a step's config and groups, in the order a user fixes them, before the pin is asked whether it
    can run them: a config mistake is reported as one even where the pin would also refuse. Returns whether the
    step runs dynamic CP (:func:`dynamic_cp_switch`, read once the config is known to be readable).

    ``config_fields`` are the pin's config fields; ``registered`` its own scheduler names.
    """
    require_groups(pg_collection)
    check_config_object(model_config)
    check_switches(model_config)
    dynamic_cp = dynamic_cp_switch(model_config, config_fields)
    scheduler_name(model_config, registered=registered)
    check_virtual_stages(model_config, dynamic_cp=dynamic_cp)
    check_pipeline_shapes(model_config, pg_collection.pp.size())
    if dynamic_cp:
        pool = check_dynamic_cp_pool(pg_collection.dp.size(), pg_collection.cp.size())
        minimum = getattr(model_config, "min_dynamic_context_parallel_size", 1)
        check_min_dynamic_cp_size("model_config.min_dynamic_context_parallel_size", minimum, pool)
    max_seqlen_per_dp_cp_rank(model_config)
    check_thd_settings(model_config)
    check_moe_dispatcher(model_config)
    return dynamic_cp


def require_fields(model_config: Any, fields: tuple[str, ...], why: str) -> None:
    """Each of ``fields`` exists on the config (None is a value), or raise naming the first missing one."""
    for name in fields:
        if not hasattr(model_config, name):
            raise PackingConfigError(
                f"model_config has no {name!r}, which {why} reads; set model_config.{name} "
                "(None when unused, as TransformerConfig defaults it)"
            )


PG_GROUPS = ("tp", "pp", "cp", "dp", "dp_cp")
"""The groups of the ``ProcessGroupCollection`` a packing step reads."""
_BUILD_PG = "ProcessGroupCollection.use_mpu_process_groups(required_pgs=['tp', 'pp', 'cp', 'dp', 'dp_cp'])"


def require_pg_collection(pg_collection: Any) -> None:
    """A collection was passed (Megatron-Core's fallback to ``parallel_state`` is not taken)."""
    if pg_collection is None:
        raise PackingConfigError(
            f"pg_collection=None: global-batch packing needs the model's ProcessGroupCollection (e.g. {_BUILD_PG})"
        )


def invalid_groups(problem: str) -> PackingConfigError:
    """The error of process groups that do not match the step's layout (``problem`` names what was found)."""
    return PackingConfigError(problem)


def require_groups(pg_collection: Any) -> None:
    """The collection holds every group of :data:`PG_GROUPS`, and its DP x CP group is its DP and CP groups'."""
    require_pg_collection(pg_collection)
    missing = [name for name in PG_GROUPS if getattr(pg_collection, name, None) is None]
    if missing:
        raise PackingConfigError(
            f"pg_collection has no {', '.join(missing)} group: global-batch packing reads tp, pp, cp, dp and dp_cp; "
            f"build it with {_BUILD_PG}"
        )
    dp, cp, dp_cp = pg_collection.dp.size(), pg_collection.cp.size(), pg_collection.dp_cp.size()
    if dp * cp != dp_cp:
        raise PackingConfigError(
            f"pg_collection.dp ({dp} ranks) x pg_collection.cp ({cp}) is not pg_collection.dp_cp ({dp_cp}): the "
            "groups do not belong to one layout (e.g. dp holds the data-parallel group with context parallelism, "
            f"which is dp_cp); build it with {_BUILD_PG}"
        )


def step_limits(model_config: Any, pg_collection: Any, dynamic_cp: bool) -> Limits:
    """The alignment and capacity every sequence of a step must meet on this layout.

    Capacity is ``max_seqlen_per_dp_cp_rank`` times the CP size (static CP) or the DP x CP pool
    (dynamic CP: a sequence may spread over the whole pool).
    """
    capacity = max_seqlen_per_dp_cp_rank(model_config)
    dp, cp, tp = pg_collection.dp.size(), pg_collection.cp.size(), pg_collection.tp.size()
    align = alignment_multiple(
        dynamic_cp=dynamic_cp,
        dp=dp,
        cp=cp,
        tp=tp,
        sequence_parallel=getattr(model_config, "sequence_parallel", False) is True,
    )
    return Limits(align, capacity * cp * (dp if dynamic_cp else 1))


def _word(value: Any) -> int:
    """One setting as an int64 word: a bool as 0/1, an int as itself, a string by CRC-32, None as 0, a pipeline
    layout (``.layout``: per rank, per virtual stage, its layers) by the CRC-32 of its layer names, else -1."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if NOT_AN_INT < value < -NOT_AN_INT else NOT_AN_INT
    if isinstance(value, str):
        return zlib.crc32(value.encode())
    if value is None:
        return 0
    stages = getattr(value, "layout", None)
    if isinstance(stages, list | tuple):
        names = [[[str(getattr(layer, "name", layer)) for layer in stage] for stage in rank] for rank in stages]
        return zlib.crc32(repr(names).encode())
    return -1


def settings_words(model_config: Any) -> list[int]:
    """The fields of :data:`~mcore_compat.problems.SETTINGS_FIELDS` as words the agreement compares.

    Ranks that read a step with different settings would schedule different bins and then wait in
    different collectives; comparing them in the agreement makes every rank raise instead.
    """
    return [_word(_read(model_config, name)) for name in SETTINGS_FIELDS]


def _read(model_config: Any, name: str) -> Any:
    """``model_config.name``: None when absent, an object (word -1) where reading it raises (a rank that refused
    the config joins the agreement with it: see :func:`check_config_object`)."""
    try:
        return getattr(model_config, name, None)
    except Exception:  # noqa: BLE001 - any error of the config's own attribute access
        return object()
