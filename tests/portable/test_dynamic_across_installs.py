"""Dynamic CP on a release or main equals Megatron-Core dev's native ``default_dynamic_cp``, bin for bin.

Needs ``$MCORE_SRC_DEV``, a Megatron-LM dev checkout whose own scheduler runs ``default_dynamic_cp``, and the
tree to compare, which runs dynamic CP on the portable backend: ``$MCORE_SRC`` (e.g. main tip) where set, else
the installed megatron-core release (0.16.1 on; nox's release pin sessions pass ``MCORE_SRC_DEV`` through).
The same cases run through the ``packing`` facade twice, in two process groups: once on dev (native), once
on the compared tree (with ``packing.enable_dynamic_cp_model_support()`` applied, as a trainer does). Every
``mcore_compat.testing`` check passes on both, and on every rank, step and microbatch the two agree on the
samples and their order, the tensors, ``cu_seqlens_padded``, the CP size and the ranks of the CP group. One
documented difference is allowed: dev's ``cu_seqlens_q``/``kv`` hold the real boundaries where releases and
main (and the portable backend) use the padded ones.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

from mcore_compat.generations import GENERATIONS
from mcore_compat.testing import CaseRun, run_cases
from mcore_compat.testing.records import MicrobatchRecord
from tests.claims import refused
from tests.portable.ranks import DYNAMIC_CASES, same_value

DEV_SRC = os.environ.get("MCORE_SRC_DEV")
SUBJECT_SRC = os.environ.get("MCORE_SRC") if os.environ.get("MCORE_SRC") != DEV_SRC else None
"""The tree compared with dev: ``$MCORE_SRC`` (e.g. a main checkout) where set, else the installed release."""


def _installed_release() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _is_tree(src: str | None) -> bool:
    return bool(src) and Path(str(src), "megatron", "core", "__init__.py").is_file()


SUBJECT = f"MCORE_SRC={SUBJECT_SRC}" if SUBJECT_SRC else f"megatron-core {_installed_release()}"
pytestmark = pytest.mark.skipif(
    not _is_tree(DEV_SRC) or not (_is_tree(SUBJECT_SRC) if SUBJECT_SRC else _installed_release()),
    reason="needs MCORE_SRC_DEV, a Megatron-LM dev checkout (git clone -b dev "
    "https://github.com/NVIDIA/Megatron-LM.git mlm-dev), and the tree to compare: an installed release "
    "(pip install megatron-core==0.16.1) or MCORE_SRC",
)

CASES = DYNAMIC_CASES
COMPARED = (
    "tokens",
    "labels",
    "loss_mask",
    "position_ids",
    "padding_mask",
    "cu_seqlens_q_padded",
    "cu_seqlens_kv_padded",
    "max_seqlen_q",
    "max_seqlen_kv",
    "local_cp_size",
    "cp_group_ranks",
    "cp_group_rank",
    "attention_mask_is_none",
    "qkv_format",
)


@pytest.fixture(scope="module")
def runs() -> dict[str, list[CaseRun]]:
    dev = run_cases(CASES, sys_path=[str(Path(str(DEV_SRC)).resolve())], timeout=900)
    if any(run.backend != "native" for run in dev):
        pytest.skip(f"MCORE_SRC_DEV is {dev[0].generation}, not a dev tree with a native default_dynamic_cp")
    subject = run_cases(CASES, sys_path=[str(Path(SUBJECT_SRC).resolve())] if SUBJECT_SRC else [], timeout=900)
    row = GENERATIONS.get(subject[0].generation or "")
    if row is not None and "default_dynamic_cp" in row.dynamic_cp_schedulers:
        pytest.skip(f"{SUBJECT} ({row.id}) runs default_dynamic_cp natively: compare a release or main with dev")
    refusals = [run.skipped for run in subject if run.skipped]
    if refusals:
        refused("default_dynamic_cp", True, f"{SUBJECT} does not run dynamic CP: {refusals[0]}")
    return {"dev": dev, "subject": subject}


def _differences(dev: MicrobatchRecord, subject: MicrobatchRecord) -> list[str]:
    return [key for key in COMPARED if not same_value(getattr(dev, key), getattr(subject, key))]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c.name}-{c.max_seqlen_per_dp_cp_rank}" for c in CASES])
def test_matches_dev_native(runs, index):
    dev, subject = runs["dev"][index], runs["subject"][index]
    assert dev.errors() == [] and subject.errors() == []
    for step, (dev_ranks, subject_ranks) in enumerate(zip(dev.steps, subject.steps, strict=True)):
        for d, r in zip(dev_ranks, subject_ranks, strict=True):
            where = f"step {step} rank {d.rank}"
            assert (r.num_microbatches, r.seqlen_sum, r.seqlen_squared_sum) == (
                d.num_microbatches,
                d.seqlen_sum,
                d.seqlen_squared_sum,
            ), where
            assert len(r.microbatches) == len(d.microbatches), where
            for k, (d_mb, r_mb) in enumerate(zip(d.microbatches, r.microbatches, strict=True)):
                assert _differences(d_mb, r_mb) == [], f"{where} microbatch {k}"
                assert same_value(r_mb.cu_seqlens_q, r_mb.cu_seqlens_q_padded), f"{where} microbatch {k}"


def test_the_comparison_is_live(runs):
    """Bins ran on groups of sizes 1, 2 and 4 on the compared tree; dev's real boundaries differ somewhere."""
    mbs = [mb for run in runs["subject"] for step in run.steps for rank in step for mb in rank.microbatches]
    assert {mb.local_cp_size for mb in mbs} >= {1, 2, 4}
    assert {len(mb.cp_group_ranks) for mb in mbs} >= {1, 2, 4}
    dev_mbs = [mb for run in runs["dev"] for step in run.steps for rank in step for mb in rank.microbatches]
    assert any(not same_value(mb.cu_seqlens_q, mb.cu_seqlens_q_padded) for mb in dev_mbs)
