"""Fake M3 (main a9381be598, #6684 .. main tip d98e8a64dd): ``wrap_data_iterator`` over an enum registry.

``scheduler_map`` is keyed by ``PackingSchedulerEnum`` and looked up with ``name.upper()``; the fetch is
M2's (5 parameters, seven values); only the first and last PP stages own data.
"""

from __future__ import annotations

from tests.fake_mcore import FakeMCore, data_loader_wrapper, main_schedulers, main_wrap
from tests.fake_mcore.m1 import main_base, main_fetch

GENERATIONS = ("M3",)


def build(generation: str = "M3", *, record: bool = True) -> FakeMCore:
    """The modules of the first M3 commit (and the main tip), on the paths the facade and detection read."""
    fake = main_base(generation, record=record, fetch_arity=7)
    enum_type, scheduler_map = main_schedulers(fake)
    fake.module(
        "megatron.core.datasets.data_schedule",
        PackingSchedulerEnum=enum_type,
        scheduler_map=scheduler_map,
        wrap_data_iterator=main_wrap(fake, enum_type, scheduler_map),
        get_batch_on_this_rank_for_sequence_packing=main_fetch(fake),
        HybridCPDataLoaderWrapper=data_loader_wrapper("HybridCPDataLoaderWrapper"),
    )
    return fake
