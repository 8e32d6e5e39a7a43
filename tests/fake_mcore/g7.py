"""Fake G7/G8 (dev 3f49de20de, #6387 / dev tip d48bd6be0a, #6378): THD CP-layout routes.

``megatron.core.context_parallel_layout`` becomes a package exposing
``prebuild_thd_cp_partition_routes`` and ``PackedSeqParams`` gains ``cp_partition_route``. G8 replaces
the all-to-all reroute with an all-gather: ``reroute_samples_to_dcp_ranks`` loses ``tp_group`` and
``total_dcp_gpus`` (7 parameters) and ``_REROUTE_KEY_ORDER`` appears.
"""

from __future__ import annotations

from typing import Any

from tests.fake_mcore import REQUIRED_SAMPLE_KEYS, FakeMCore, mtp_by_layout
from tests.fake_mcore.g4 import DYNAMIC_CONFIG_FIELDS, initialize_model_parallel
from tests.fake_mcore.g5 import PADDING_CONFIG_FIELDS, PSP_FIELDS, install_data_schedule, packed_seq_params_functions
from tests.fake_mcore.g5 import utils_g6 as utils_g7

GENERATIONS = ("G7", "G8")


def build(generation: str, *, record: bool = True) -> FakeMCore:
    """The modules of the first G7 commit or the dev tip, on the paths the facade and detection read."""
    fake = FakeMCore(generation, version="0.19.0", data_stages="every", fetch_arity=7, record=record)
    fake.packed_seq_params((*PSP_FIELDS["G6b"], "cp_partition_route"), **packed_seq_params_functions(fake, "G6b"))
    fake.model_parallel_config((*DYNAMIC_CONFIG_FIELDS, *PADDING_CONFIG_FIELDS["G6b"]))
    fake.parallel_state(initialize_model_parallel, getter="get_dynamic_data_context_parallel_groups")
    mtp_by_layout(fake)
    install_layout_package(fake)
    install_data_schedule(fake, utils=utils_g7() if generation == "G7" else utils_g8())
    return fake


def install_layout_package(fake: FakeMCore) -> None:
    """The ``context_parallel_layout`` package; the prebuild mutates ``cp_partition_route`` and returns None."""

    @fake.record
    def prebuild_thd_cp_partition_routes(packed_seq_params, cp_group=None, *, device=None):
        group = cp_group if cp_group is not None else getattr(packed_seq_params, "cp_group", None)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd" or group is None or group.size() <= 1:
            return None
        packed_seq_params.cp_partition_route = ("route", group.name, group.size(), group.rank())
        return None

    def finalize_packed_seq_params(packed_seq_params):
        raise AssertionError("needs parallel_state initialised; the facade binds the group itself")

    fake.module(
        "megatron.core.context_parallel_layout",
        package=True,
        prebuild_thd_cp_partition_routes=prebuild_thd_cp_partition_routes,
        finalize_packed_seq_params=finalize_packed_seq_params,
    )
    fake.module(
        "megatron.core.context_parallel_layout.routes",
        prebuild_thd_cp_partition_routes=prebuild_thd_cp_partition_routes,
    )


def utils_g8() -> dict[str, Any]:
    """``data_schedule_utils`` shapes of G8: the 7-parameter all-gather reroute."""

    def reroute_samples_to_dcp_ranks(
        batch, global_ids_this_rank, global_id_seqlens, sample_id_groups, offsets, dp_group, dp_cp_group
    ): ...

    utils = utils_g7()
    utils.update(
        reroute_samples_to_dcp_ranks=reroute_samples_to_dcp_ranks,
        _REROUTE_KEY_ORDER=REQUIRED_SAMPLE_KEYS,
    )
    return utils
