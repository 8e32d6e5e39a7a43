"""Fake G5/G6/G6b (dev 7f9175207d, #4359 / bfa33263ca, #5087 / 1392f28a5a, #5541): fetch takes ``config``.

The fetch gains a trailing ``config=None`` and returns seven values (``padding_mask``);
``BasePackingScheduler`` takes ``max_num_seqs``. G6 adds ``PackedSeqParams.cp_partition_mode`` and the
single-module ``context_parallel_layout`` (no route prebuild); G6b adds
``packed_seq_params.resolve_thd_tail_padding_policy`` and the ``thd_tail_padding_policy`` config field.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from tests.fake_mcore import (
    PSP_FIELDS_TOTAL_TOKENS,
    FakeMCore,
    data_loader_wrapper,
    dev_schedulers,
    dev_wrap,
    mtp_by_layout,
    resolve_cp_group_of,
)
from tests.fake_mcore.g4 import DYNAMIC_CONFIG_FIELDS, initialize_model_parallel, reroute_samples_to_dcp_ranks

GENERATIONS = ("G5", "G6", "G6b")
PSP_FIELDS = {
    "G5": (*PSP_FIELDS_TOTAL_TOKENS, "pad_between_seqs"),
    "G6": (*PSP_FIELDS_TOTAL_TOKENS, "pad_between_seqs", "cp_partition_mode"),
    "G6b": (*PSP_FIELDS_TOTAL_TOKENS, "pad_between_seqs", "cp_partition_mode", "tokens_per_sample"),
}
PADDING_CONFIG_FIELDS = {
    "G5": ("pad_packed_seq_alignment", "pad_packed_seq_by_appending_dummy_seq"),
    "G6": ("pad_packed_seq_alignment", "pad_packed_seq_by_appending_dummy_seq"),
    "G6b": ("pad_packed_seq_alignment", "thd_tail_padding_policy"),
}


def build(generation: str, *, record: bool = True) -> FakeMCore:
    """The modules of the first G5, G6 or G6b commit, on the paths the facade and detection read."""
    fake = FakeMCore(generation, version="0.19.0", data_stages="every", fetch_arity=7, record=record)
    fake.packed_seq_params(PSP_FIELDS[generation], **packed_seq_params_functions(fake, generation))
    fake.model_parallel_config((*DYNAMIC_CONFIG_FIELDS, *PADDING_CONFIG_FIELDS[generation]))
    fake.parallel_state(initialize_model_parallel, getter="get_dynamic_data_context_parallel_groups")
    mtp_by_layout(fake)
    if generation != "G5":
        fake.module("megatron.core.context_parallel_layout", **single_module_layout())
    install_data_schedule(fake, utils=utils_g5() if generation == "G5" else utils_g6())
    return fake


def install_data_schedule(fake: FakeMCore, utils: dict[str, Any]) -> ModuleType:
    """G5+ ``data_schedule`` (7-parameter fetch returning 7 values) and ``data_schedule_utils``."""
    scheduler_map = dev_schedulers(fake, max_num_seqs=True, dynamic=True)

    @fake.record
    def get_batch_on_this_rank_for_sequence_packing(
        data_iterator,
        vpp_size=None,
        mtp_on_this_rank=False,
        vp_stage=None,
        dynamic_cp=False,
        pg_collection=None,
        config=None,
    ):
        return fake.fetch(data_iterator, pg_collection, dynamic_cp=dynamic_cp, sets_cp_size=True)

    fake.module("megatron.core.datasets.data_schedule_utils", **utils)
    return fake.module(
        "megatron.core.datasets.data_schedule",
        scheduler_map=scheduler_map,
        wrap_data_iterator=dev_wrap(fake, scheduler_map, max_num_seqs=True),
        get_batch_on_this_rank_for_sequence_packing=get_batch_on_this_rank_for_sequence_packing,
        HybridCPDataLoaderWrapper=data_loader_wrapper("HybridCPDataLoaderWrapper"),
    )


def packed_seq_params_functions(fake: FakeMCore, generation: str) -> dict[str, Any]:
    """``resolve_cp_group`` (G4b+) and, from G6b, ``resolve_thd_tail_padding_policy``."""
    functions: dict[str, Any] = {"resolve_cp_group": resolve_cp_group_of(fake)}
    if generation not in ("G5", "G6"):

        def resolve_thd_tail_padding_policy(config):
            return getattr(config, "thd_tail_padding_policy", None) or "append_dummy_seq"

        functions["resolve_thd_tail_padding_policy"] = resolve_thd_tail_padding_policy
    return functions


def single_module_layout() -> dict[str, Any]:
    """The pre-G7 ``context_parallel_layout.py`` module: index helpers, no route prebuild."""

    def get_thd_context_parallel_rank_indices(cu_seqlens, cp_size, cp_rank, layout): ...

    def zigzag_to_contiguous_chunks(*args, **kwargs): ...

    def contiguous_to_zigzag_chunks(*args, **kwargs): ...

    return {
        f.__name__: f
        for f in (get_thd_context_parallel_rank_indices, zigzag_to_contiguous_chunks, contiguous_to_zigzag_chunks)
    }


def utils_g5() -> dict[str, Any]:
    """``data_schedule_utils`` shapes of G5."""

    def create_data_iterator(new_samples, tp_group, config, vpp_needs_data=None, is_dynamic_cp=False): ...

    def get_cp_slice_for_thd(batch, cp_group, keys=None): ...

    return {f.__name__: f for f in (create_data_iterator, reroute_samples_to_dcp_ranks, get_cp_slice_for_thd)}


def utils_g6() -> dict[str, Any]:
    """``data_schedule_utils`` shapes of G6-G7 (``get_cp_slice_for_thd`` takes the partition mode)."""

    def create_data_iterator(new_samples, tp_group, config, vpp_needs_data=None, is_dynamic_cp=False): ...

    def get_cp_slice_for_thd(batch, cp_group, keys=None, cp_partition_mode="zigzag", partition_total_tokens=None): ...

    return {f.__name__: f for f in (create_data_iterator, reroute_samples_to_dcp_ranks, get_cp_slice_for_thd)}
