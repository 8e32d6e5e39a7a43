"""Padding follows the pin, on real Megatron-LM trees: the generation fact against each tree's own fetch, and a real
4-rank step whose padding holds -1, -100 or an id past any vocabulary fetching the microbatches of zero padding.

For the first commit of every generation and both pinned tips (``tests/real_trees.py``), on 4 gloo ranks (tp·cp·dp
1·2·2), with static CP (``dp_balanced``) and dynamic CP (``default_dynamic_cp``, where the pin runs it):

* Megatron-Core's own fetch, handed a packed microbatch with -7 in every padding slot, returns 0 there exactly where
  the table says it overwrites padding (``Generation.fetch_sanitises_padding``);
* through the facade each padding id gives every rank the same outcome as zero padding, with the same fetched
  microbatches, and zero padding runs wherever ``tests/real_outcomes.py`` says a real step does.

Run with ``-m history`` (``nox -s test-mcore-history``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

from mcore_compat.generations import FETCH_FUNCTION, GENERATIONS, SCHEDULER_MODULE
from mcore_compat.testing import Case, Layout, launch
from mcore_compat.testing.patches import cpu_patches
from mcore_compat.testing.runner import _init_parallel_state, model_config, mpu_pg_collection
from tests.bad_input_ranks import BadInput, bad_inputs_on_rank
from tests.real_outcomes import RUNS
from tests.real_trees import AVAILABLE, FIRST_COMMITS, HOW_TO_GET_ONE, TIPS, tree

pytestmark = [pytest.mark.history, pytest.mark.skipif(not AVAILABLE, reason=HOW_TO_GET_ONE)]

LAYOUT = Layout(1, 2, 2)
BASE = {"num_microbatches": 4, "max_seqlen_per_dp_cp_rank": 32}
PAD_IDS = (0, -1, -100, 2**40)


def _name(pad: int, dynamic: bool) -> str:
    return f"padding {pad}, {'dynamic' if dynamic else 'static'} CP"


CASES = [
    BadInput(_name(pad, dynamic), f"pad_ids:{pad}", index=-1, dp_rank=None, dynamic_cp=dynamic)
    for dynamic in (False, True)
    for pad in PAD_IDS
]
TREES = [*FIRST_COMMITS, *((gen, commit[:10]) for commit, gen in TIPS.values())]
MARK = -7
LENGTHS = (4, 8)


def _marked(sequences: list[torch.Tensor]) -> torch.Tensor:
    """The sequences back to back, each padded to its length in :data:`LENGTHS` with :data:`MARK`."""
    return torch.cat([torch.cat((s, torch.full((n - len(s),), MARK))) for s, n in zip(sequences, LENGTHS, strict=True)])


def _packed_microbatch() -> dict[str, torch.Tensor]:
    """Two sequences as a scheduler yields them: 3 of 4 and 5 of 8 tokens real, :data:`MARK` in every padding slot."""
    real = [torch.arange(1, 4), torch.arange(11, 16)]
    tokens = _marked(real)
    return {
        "tokens": tokens,
        "labels": tokens.clone(),
        "loss_mask": (tokens != MARK).float(),
        "position_ids": _marked([torch.arange(len(s)) for s in real]),
        "cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor([0, 4, 12], dtype=torch.int32),
        "max_seqlen": torch.tensor(8, dtype=torch.int32),
    }


def _own_fetch_keeps_padding() -> bool | None:
    """Whether Megatron-Core's own fetch hands :data:`MARK` on from a padding slot to this CP rank (None: the pin has
    no fetch of its own)."""
    try:
        fetch = getattr(importlib.import_module(SCHEDULER_MODULE), FETCH_FUNCTION, None)
    except ImportError:
        return None
    if fetch is None:
        return None
    case = Case(LAYOUT, "dp_balanced", steps=1, **BASE)
    with cpu_patches(context_parallel=True):
        _init_parallel_state(case)
        try:
            params = inspect.signature(fetch).parameters
            keywords: dict[str, Any] = {"pg_collection": mpu_pg_collection()}
            keywords |= {"dynamic_cp": False} if "dynamic_cp" in params else {}
            keywords |= {"config": model_config(case)} if "config" in params else {}
            batch = fetch(iter([_packed_microbatch()]), **keywords)
        finally:
            importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()
    return any(bool((field == MARK).any()) for field in (batch[0], batch[1], batch[4]))


def _on_rank(rank: int, world_size: int) -> dict[str, Any]:
    from mcore_compat import detect

    with cpu_patches():
        detect()
    result = bad_inputs_on_rank(rank, world_size, LAYOUT, CASES, BASE)
    result["fetch_keeps_padding"] = _own_fetch_keeps_padding()
    return result


@pytest.mark.parametrize(("generation", "commit"), TREES, ids=[f"{g}-{c}" for g, c in TREES])
def test_padding_ids_run_as_zero_padding_on_a_real_tree(generation: str, commit: str) -> None:
    per_rank = launch(_on_rank, LAYOUT.world_size, sys_path=[str(tree(commit))], timeout=300, pg_timeout=30)
    assert per_rank[0]["generation"] == generation
    fact = GENERATIONS[generation].fetch_sanitises_padding
    keeps = [ranks["fetch_keeps_padding"] for ranks in per_rank]
    if keeps[0] is None:
        assert fact is None, f"{generation} {commit}: the table has a fetch fact for a tree without a fetch"
    else:
        observed = not any(keeps)
        assert observed == fact, f"{generation} {commit}: the table says {fact}, the real fetch overwrites: {observed}"
    runs: dict[str, list] = {}
    for ranks in per_rank:
        for outcome in ranks["outcomes"]:
            runs.setdefault(outcome.name, []).append(outcome)
    for dynamic, request in ((False, ("dp_balanced", False)), (True, ("default_dynamic_cp", True))):
        zero = runs[_name(0, dynamic)]
        if RUNS[generation][request]:
            assert {o.kind for o in zero} == {"ok"}, f"{generation} {request}: {[o.message for o in zero][:1]}"
        for pad in PAD_IDS[1:]:
            got = runs[_name(pad, dynamic)]
            for mine, ref in zip(got, zero, strict=True):
                assert (mine.kind, mine.message) == (ref.kind, ref.message), f"{generation} pad {pad}: {mine.message}"
                assert mine.fetched == ref.fetched, f"{generation} pad {pad}: rank {mine.rank} fetched otherwise"
