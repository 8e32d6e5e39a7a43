"""Facts about Megatron-Core's global-batch packing API generations, written once.

Each :class:`Generation` row says what distinguishes it (the features detection observes, see
:mod:`mcore_compat.capabilities`) and everything the adapters and the probe need to know about it:
the packed fetch's optional keywords and tuple arity, which pipeline stages load data, which sample
forms the scheduler accepts, the dynamic-CP group getter, how the schedule and attention react to
context-parallel flags and groups, and which adapter serves it. Nothing else in ``mcore_compat`` or
``packing`` spells out a Megatron-LM commit hash (``pins.toml`` names the pinned commits).

Detection walks :data:`GENERATIONS` and takes the row whose ``requires`` features are all present and
whose ``excludes`` features are all absent; the rows are written so that at most one matches. A shape
no row describes is served feature-first by the adapter whose contract its signatures speak.

Adding a generation (``tests/test_generations.py`` fails until every step is done):

1. one row below, with the first commit and the features that set it apart from its neighbours;
   add a feature name to :data:`FEATURES` (and its observation to ``capabilities._features``) if
   no existing one distinguishes it;
2. at most one adapter class under ``mcore_compat/adapters/`` (most rows reuse one), named in the
   row's ``adapter``;
3. one fake under ``tests/fake_mcore/`` that builds the row's modules (listed in that family's
   ``GENERATIONS``);
4. a pin in ``pins.toml`` if the generation is installable as one, its row in README's support
   table, and a ``CHANGELOG.md`` entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "CP_INIT_KEYWORDS",
    "DYNAMIC_CP_GROUP_GETTERS",
    "FEATURES",
    "FETCH_FUNCTION",
    "MODEL_COMPONENTS",
    "ModelComponent",
    "PACKING_CONFIG_FIELDS",
    "PACKING_MOE_DISPATCHERS",
    "PP_BROADCAST_FUNCTION",
    "RERUN_MACHINE",
    "RERUN_MODULE",
    "RERUN_REPLAY_STATE",
    "SCALARS_BROADCAST_FUNCTION",
    "SCHEDULER_MODULE",
    "SCHEDULER_UTILS_MODULE",
    "WRAP_FUNCTION",
    "GENERATIONS",
    "Generation",
    "PipelineDataStages",
    "VirtualStageSource",
    "SampleForm",
    "match",
]

SCHEDULER_MODULE = "megatron.core.datasets.data_schedule"
SCHEDULER_UTILS_MODULE = "megatron.core.datasets.data_schedule_utils"
TE_EXTENSIONS_MODULE = "megatron.core.extensions.transformer_engine"
"""Where dev's ``get_thd_partitioned_indices`` (Transformer Engine's THD partition) lives; the scheduler's utils import
it by name, and G5's THD padding (``packed_seq_params``) imports it from here when it runs."""
WRAP_FUNCTION = "wrap_data_iterator"
FETCH_FUNCTION = "get_batch_on_this_rank_for_sequence_packing"
SCALARS_BROADCAST_FUNCTION = "broadcast_scalars"
"""The function of :data:`SCHEDULER_UTILS_MODULE`, ``(values, group, dev)``, with which every native generation's
``wrap_data_iterator`` sends its TP rank 0's microbatch count and FLOPs sums to the other TP ranks (G2-G8, M3)."""
STATIC_SCHEDULERS: tuple[str, ...] = ("dp_balanced",)
"""Megatron-Core's scheduler names for static context parallelism (its registry's string keys)."""
DYNAMIC_CP_SCHEDULERS: tuple[str, ...] = ("default_dynamic_cp",)
"""Megatron-Core's scheduler names that form dynamic context-parallel groups."""
PACKING_MOE_DISPATCHERS = ("alltoall", "flex")
"""The MoE token dispatchers dev's ``TransformerConfig`` accepts with a packing scheduler (it asserts so when the
scheduler is given to its constructor): ``allgather`` gathers equal token counts over the TP x EP ranks, while the
DP ranks an expert-parallel group spans run packed bins of different lengths."""
RERUN_MODULE = "megatron.core.rerun_state_machine"
RERUN_MACHINE = "_GLOBAL_RERUN_STATE_MACHINE"
"""The module global of :data:`RERUN_MODULE` holding the rerun state machine once a trainer initialized it (its
getter would initialize one)."""
RERUN_REPLAY_STATE = "RERUNNING_IN_PLACE"
"""The name of the machine's ``state`` while it reruns a step in place: Megatron-LM's ``train_step`` then rewinds the
packed iterator (a ``RerunDataIterator``) ``wrap`` returned and fetches the step's microbatches again, the machine's
state identical on every rank (it is decided in a collective)."""
PP_BROADCAST_FUNCTION = "broadcast_to_pp_group"
"""The function of :data:`SCHEDULER_UTILS_MODULE`, ``(new_samples, num_micro_batches, seqlen_sum,
seqlen_squared_sum, pp_group, dev)``, with which the ``wrap_data_iterator`` of every generation whose first and last
PP stages load data (``pipeline_data_stages="first_last"``: G2-G4, M3) hands the schedule from PP rank 0 to the
middle stages when PP > 2, before the TP broadcast; the last stage joins and drops it. Its presence is the feature
``utils.broadcast_to_pp_group``."""
DYNAMIC_CP_GROUP_GETTERS = ("get_dynamic_data_context_parallel_groups", "get_hybrid_data_context_parallel_groups")
PACKING_CONFIG_FIELDS = (
    "sequence_packing_scheduler",
    "max_seqlen_per_dp_cp_rank",
    "hybrid_context_parallel",
    "dynamic_context_parallel",
    "min_dynamic_context_parallel_size",
    "pad_packed_seq_alignment",
    "pad_packed_seq_by_appending_dummy_seq",
    "thd_tail_padding_policy",
)
CP_INIT_KEYWORDS = ("hybrid_context_parallel", "dynamic_context_parallel", "min_dynamic_context_parallel_size")

PipelineDataStages = Literal["first_last", "every"]
VirtualStageSource = Literal["first_present", "by_pipeline_stage"]
SampleForm = Literal["unpacked", "packed"]
ModelComponent = Literal["attention", "te_cp_stream", "mla", "mtp", "moe_aux_loss", "mamba"]
MODEL_COMPONENTS: tuple[ModelComponent, ...] = ("attention", "te_cp_stream", "mla", "mtp", "moe_aux_loss", "mamba")
"""Model code paths that must follow a microbatch's dynamic CP group (mcore-api-generations §8.1)."""

FEATURES: dict[str, str] = {
    "data_schedule": "megatron.core.datasets.data_schedule imports",
    "wrap": "data_schedule.wrap_data_iterator exists",
    "fetch": "data_schedule.get_batch_on_this_rank_for_sequence_packing exists",
    "fetch.dynamic_cp": "the packed fetch takes dynamic_cp",
    "fetch.config": "the packed fetch takes config",
    "registry.str": "scheduler_map is keyed by str",
    "registry.enum": "scheduler_map is keyed by PackingSchedulerEnum",
    "DynamicCPDataLoaderWrapper": "data_schedule.DynamicCPDataLoaderWrapper exists",
    "utils.create_data_iterator": "data_schedule_utils.create_data_iterator exists",
    "utils.broadcast_to_pp_group": f"data_schedule_utils.{PP_BROADCAST_FUNCTION} exists",
    "utils.reroute_all_gather": "data_schedule_utils.reroute_samples_to_dcp_ranks takes 7 parameters",
    "psp.cp_partition_mode": "PackedSeqParams has the field cp_partition_mode",
    "thd_tail_padding_policy": "packed_seq_params.resolve_thd_tail_padding_policy exists",
    "cp_layout_routes": "megatron.core.context_parallel_layout is a package with prebuild_thd_cp_partition_routes",
}

_NATIVE = frozenset({"data_schedule", "wrap", "fetch"})
_DEV = _NATIVE | {"registry.str"}
_DEV_DYNAMIC = _DEV | {"fetch.dynamic_cp"}
_DEV_CONFIG = _DEV_DYNAMIC | {"fetch.config"}
_DYNAMIC_GETTER, _HYBRID_GETTER = DYNAMIC_CP_GROUP_GETTERS
_BOTH_FORMS: tuple[SampleForm, ...] = ("unpacked", "packed")


@dataclass(frozen=True)
class Generation:
    """One shape of MCore's packing API, as first seen in one commit."""

    id: str
    lineage: Literal["release", "dev", "main"]
    first_commit: str | None
    """Abbreviated Megatron-LM commit that introduced the shape (None: before any packing code)."""
    summary: str
    where: str
    requires: frozenset[str]
    """Features (keys of :data:`FEATURES`) that must all be observed."""
    excludes: frozenset[str]
    """Features that must all be absent."""
    adapter: str
    """Class name of the adapter that serves this generation."""
    fetch_keywords: tuple[str, ...] = ()
    """Optional keywords of the packed fetch beyond the common ones (vpp_size, mtp_on_this_rank, vp_stage,
    pg_collection): ``dynamic_cp`` from G4, ``config`` from G5."""
    fetch_arity: int | None = None
    pipeline_data_stages: PipelineDataStages | None = None
    """Which PP stages' TP rank 0 load data for MCore's scheduler (None: no native scheduler)."""
    virtual_stage_source: VirtualStageSource | None = None
    """With VPP (a list of one iterator per virtual stage), which entry MCore's scheduler pulls the step's samples
    from: the first that is not None (dev), or by pipeline stage (main): ``[0]`` on the first, ``[-1]`` on the last,
    none on the middle stages (None: no native scheduler)."""
    virtual_stages_share_samples: bool = False
    """With VPP, the scheduler gives the same packed microbatch dicts to every virtual stage whose entry of the list
    was not None, and each stage's fetch drops the fields its stage does not need from them in place, so a later
    virtual stage's fetch of the same microbatch finds its fields gone (dev G2-G4): the list it gets must hold an
    iterator only in the entries this pipeline stage loads for (``[0]`` on the first, ``[-1]`` on the last)."""
    feeds_mtp_stages: bool = False
    """Whether MCore's scheduler gives the whole packed microbatch (tokens and labels) to every pipeline and virtual
    stage holding multi-token-prediction layers (dev from G4b): elsewhere a stage other than the last one holding
    them (``pipeline_model_parallel_layout``, "standalone" MTP) gets no tokens or no labels, and its fetch fails."""
    sample_forms: tuple[SampleForm, ...] | None = None
    """Sample forms MCore's scheduler accepts from the data iterator (None: no native scheduler)."""
    dynamic_cp_group_getter: str | None = None
    """``parallel_state`` function returning the DP x CP sub-group of a given size."""
    dynamic_cp_schedulers: tuple[str, ...] = ()
    """Registered scheduler names that form dynamic CP groups."""
    schedule_diverts_on: str | None = None
    """Config flag on which ``forward_backward_no_pipelining`` leaves the normal schedule for MCore's own
    hybrid/dynamic-CP schedule (which expects its data-loader wrapper's output, not THD microbatches)."""
    bound_cp_group_switches_attention: bool = False
    """Transformer Engine's attention wrapper treats any ``PackedSeqParams.cp_group`` as a per-microbatch group
    (dev from G3 reads it only while ``local_cp_size`` is set)."""
    model_follows_microbatch_cp_group: tuple[ModelComponent, ...] = ()
    """Model components that run on ``packed_seq_params.cp_group`` from the generation's first commit."""
    fetch_sanitises_padding: bool | None = None
    """Whether MCore's packed fetch writes 0 over every padding slot of ``tokens``, ``labels``, ``position_ids`` and
    ``loss_mask`` (from ``cu_seqlens`` against ``cu_seqlens_padded``) before anything reads them: dev from G5, main
    from M2 (``_sanitize_thd_padding_values``); False where it hands padding on as given (G2-G4b); None without a fetch
    of MCore's own, or for a shape no row describes."""
    dp_balanced_first_bin_donates: bool | None = None
    """Whether MCore's ``dp_balanced``, rounding its bin count up to a multiple of DP (x the VPP microbatch group),
    may split sequences off the first bin: dev (``assert i >= 0``) may, main (``assert i > 0``) stops before it and
    fails the step with "Not enough samples to move" (None: no native scheduler, or an unknown generation)."""

    @property
    def native_scheduler(self) -> bool:
        """Whether MCore itself ships ``wrap_data_iterator`` and the packed fetch."""
        return _NATIVE <= self.requires

    @property
    def padding_reaches_model(self) -> bool:
        """Whether the values of a sample's padding slots reach the model unchanged through the facade.

        Only on a native scheduler that takes unpacked samples as they are and whose fetch does not overwrite
        padding (no row yet; assumed for a shape no row describes). Where the scheduler takes only pre-packed
        samples the facade converts them and writes 0 over padding (:func:`mcore_compat.contract.convert_items`),
        and the portable backend's microbatches hold 0 there, as the newest fetch makes them.
        """
        unpacked = "unpacked" in (self.sample_forms or ())
        return self.native_scheduler and unpacked and self.fetch_sanitises_padding is not True

    @property
    def runs_dynamic_cp_natively(self) -> bool:
        """Whether MCore's own scheduler forms dynamic CP groups on this generation."""
        return bool(self.dynamic_cp_schedulers) and "dynamic_cp" in self.fetch_keywords

    def label(self) -> str:
        """``G4 (dev 2d6e946bab)``-style name for messages."""
        return f"{self.id} ({self.lineage} {self.first_commit})" if self.first_commit else self.id


def _dev(
    gen: str,
    commit: str,
    summary: str,
    where: str,
    requires: frozenset[str],
    excludes: set[str],
    *,
    keywords: tuple[str, ...],
    stages: PipelineDataStages = "every",
    shared: bool = False,
    feeds_mtp: bool = True,
    forms: tuple[SampleForm, ...] = _BOTH_FORMS,
    follows: tuple[ModelComponent, ...] = MODEL_COMPONENTS,
    sanitises: bool = True,
) -> Generation:
    dynamic = "dynamic_cp" in keywords
    return Generation(
        gen,
        "dev",
        commit,
        summary,
        where,
        requires,
        frozenset(excludes),
        "NativeSchedulerAdapter",
        fetch_keywords=keywords,
        fetch_arity=7 if "config" in keywords else 6,
        pipeline_data_stages=stages,
        virtual_stage_source="first_present",
        virtual_stages_share_samples=shared,
        feeds_mtp_stages=feeds_mtp,
        sample_forms=forms,
        dynamic_cp_group_getter=_DYNAMIC_GETTER,
        dynamic_cp_schedulers=("default_dynamic_cp",) if dynamic else (),
        model_follows_microbatch_cp_group=follows,
        fetch_sanitises_padding=sanitises,
        dp_balanced_first_bin_donates=True,
    )


_ROWS = (
    Generation(
        "G0",
        "release",
        None,
        "no packing scheduler module",
        "megatron-core 0.13.1, 0.14.0, 0.15.3",
        frozenset(),
        frozenset({"data_schedule"}),
        "PortableAdapter",
    ),
    Generation(
        "G1",
        "release",
        "98d8c56dbd",
        "hybrid-CP wrapper only (HybridCPDataLoaderWrapper)",
        "megatron-core 0.16.1-0.19.2; dev 274e04d21f; main until 574e04ebf8",
        frozenset({"data_schedule"}),
        frozenset({"wrap", "fetch", "utils.create_data_iterator"}),
        "PortableAdapter",
        dynamic_cp_group_getter=_HYBRID_GETTER,
        schedule_diverts_on="hybrid_context_parallel",
        bound_cp_group_switches_attention=True,
    ),
    Generation(
        "M1",
        "main",
        "574e04ebf8",
        "data_schedule_utils split, no scheduler",
        "main from 2026-08-18 (#5903)",
        frozenset({"data_schedule", "utils.create_data_iterator"}),
        frozenset({"wrap", "fetch"}),
        "PortableAdapter",
        dynamic_cp_group_getter=_HYBRID_GETTER,
        schedule_diverts_on="hybrid_context_parallel",
        bound_cp_group_switches_attention=True,
    ),
    Generation(
        "M2",
        "main",
        "c452d5a7ee",
        "per-rank THD fetch, no wrap_data_iterator",
        "main from 2026-08-19 (#6625)",
        frozenset({"data_schedule", "fetch"}),
        frozenset({"wrap"}),
        "PortableAdapter",
        fetch_arity=7,
        dynamic_cp_group_getter=_HYBRID_GETTER,
        schedule_diverts_on="hybrid_context_parallel",
        bound_cp_group_switches_attention=True,
        fetch_sanitises_padding=True,
    ),
    Generation(
        "M3",
        "main",
        "a9381be598",
        "enum scheduler registry (PackingSchedulerEnum)",
        "main from 2026-08-20 (#6684) to the main tip",
        _NATIVE | {"registry.enum"},
        frozenset({"fetch.dynamic_cp", "fetch.config"}),
        "NativeSchedulerAdapter",
        fetch_arity=7,
        pipeline_data_stages="first_last",
        virtual_stage_source="by_pipeline_stage",
        sample_forms=_BOTH_FORMS,
        dynamic_cp_group_getter=_HYBRID_GETTER,
        schedule_diverts_on="hybrid_context_parallel",
        bound_cp_group_switches_attention=True,
        fetch_sanitises_padding=True,
        dp_balanced_first_bin_donates=False,
    ),
    Generation(
        "G2",
        "dev",
        "5c613abf4e",
        "string scheduler registry, 5-parameter fetch",
        "dev from 2026-03-03 (#2924)",
        _DEV,
        frozenset({"fetch.dynamic_cp", "fetch.config", "DynamicCPDataLoaderWrapper"}),
        "NativeSchedulerAdapter",
        fetch_arity=6,
        pipeline_data_stages="first_last",
        virtual_stage_source="first_present",
        virtual_stages_share_samples=True,
        sample_forms=("packed",),
        dynamic_cp_group_getter=_HYBRID_GETTER,
        schedule_diverts_on="hybrid_context_parallel",
        bound_cp_group_switches_attention=True,
        fetch_sanitises_padding=False,
        dp_balanced_first_bin_donates=True,
    ),
    Generation(
        "G3",
        "dev",
        "cde56a4692",
        "hybrid -> dynamic CP rename",
        "dev from 2026-03-11 (#3405)",
        _DEV | {"DynamicCPDataLoaderWrapper"},
        frozenset({"fetch.dynamic_cp", "fetch.config"}),
        "NativeSchedulerAdapter",
        fetch_arity=6,
        pipeline_data_stages="first_last",
        virtual_stage_source="first_present",
        virtual_stages_share_samples=True,
        sample_forms=("packed",),
        dynamic_cp_group_getter=_DYNAMIC_GETTER,
        schedule_diverts_on="dynamic_context_parallel",
        model_follows_microbatch_cp_group=("attention",),
        fetch_sanitises_padding=False,
        dp_balanced_first_bin_donates=True,
    ),
    _dev(
        "G4",
        "2d6e946bab",
        "default_dynamic_cp scheduler, fetch takes dynamic_cp",
        "dev from 2026-04-07 (#2000)",
        _DEV_DYNAMIC | {"utils.broadcast_to_pp_group"},
        {"fetch.config"},
        keywords=("dynamic_cp",),
        stages="first_last",
        shared=True,
        feeds_mtp=False,
        forms=("packed",),
        follows=("attention", "te_cp_stream", "mtp", "mamba"),
        sanitises=False,
    ),
    _dev(
        "G4b",
        "959a542a11",
        "every PP stage loads its own data; unpacked samples are mis-packed until G5",
        "dev from 2026-06-08 (#4226)",
        _DEV_DYNAMIC,
        {"fetch.config", "utils.broadcast_to_pp_group"},
        keywords=("dynamic_cp",),
        forms=("packed",),
        follows=("attention", "te_cp_stream", "mla", "mtp", "mamba"),
        sanitises=False,
    ),
    _dev(
        "G5",
        "7f9175207d",
        "fetch takes config, returns padding_mask (7-tuple)",
        "dev from 2026-06-17 (#4359)",
        _DEV_CONFIG,
        {"psp.cp_partition_mode"},
        keywords=("dynamic_cp", "config"),
    ),
    _dev(
        "G6",
        "bfa33263ca",
        "PackedSeqParams.cp_partition_mode",
        "dev from 2026-07-03 (#5087)",
        _DEV_CONFIG | {"psp.cp_partition_mode"},
        {"thd_tail_padding_policy"},
        keywords=("dynamic_cp", "config"),
    ),
    _dev(
        "G6b",
        "1392f28a5a",
        "THD tail-padding policy",
        "dev from 2026-07-30 (#5541)",
        _DEV_CONFIG | {"psp.cp_partition_mode", "thd_tail_padding_policy"},
        {"cp_layout_routes"},
        keywords=("dynamic_cp", "config"),
    ),
    _dev(
        "G7",
        "3f49de20de",
        "THD CP-layout routes (prebuild_thd_cp_partition_routes)",
        "dev from 2026-08-19 (#6387)",
        _DEV_CONFIG | {"psp.cp_partition_mode", "thd_tail_padding_policy", "cp_layout_routes"},
        {"utils.reroute_all_gather"},
        keywords=("dynamic_cp", "config"),
    ),
    _dev(
        "G8",
        "d48bd6be0a",
        "all-gather reroute",
        "dev from 2026-08-21 (#6378) to the dev tip",
        _DEV_CONFIG
        | {"psp.cp_partition_mode", "thd_tail_padding_policy", "cp_layout_routes", "utils.reroute_all_gather"},
        set(),
        keywords=("dynamic_cp", "config"),
    ),
)

GENERATIONS: dict[str, Generation] = {row.id: row for row in _ROWS}


def match(features: frozenset[str]) -> Generation | None:
    """The row whose markers the observed ``features`` satisfy, or None for a shape no row describes."""
    found = [row for row in _ROWS if row.requires <= features and not row.excludes & features]
    return found[0] if len(found) == 1 else None
