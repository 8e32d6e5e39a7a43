"""Detection on real Megatron-LM history: the first commit of every generation, its parent, and both tips.

Needs ``MCORE_REPO`` (a Megatron-LM git repository); ``megatron/`` of each commit is extracted once into
``MCORE_TREES`` (see ``tests/real_trees.py``) and ``python -m mcore_compat doctor --json`` runs in a fresh
interpreter with ``PYTHONPATH=<tree>``. The doctor's capability record is also compared with the fake of the same
generation, so the fakes the facade suite runs against are checked against the real thing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mcore_compat
from mcore_compat.adapters import ADAPTERS, UnsupportedAdapter
from tests.conftest import FAKE_GENERATIONS, PROJECT, doctor_report
from tests.fake_mcore import installed
from tests.real_trees import FIRST_COMMITS, HOW_TO_GET_ONE, REPO, TIPS, scheduler_commits, tree

pytestmark = [
    pytest.mark.history,
    pytest.mark.skipif(REPO is None, reason=HOW_TO_GET_ONE),
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="triton is not installed: `import megatron.core` needs it on the newer trees, as a trainer has it "
        "(`pip install triton==3.8.0`, what the main and dev pins install; `nox -s test-mcore-history` does)",
    ),
]

FIRST_COMMITS_AND_G1_ON_DEV = [*FIRST_COMMITS, ("G1", "274e04d21f")]
PREVIOUS_GENERATION = {
    # generation -> what the parent of its first commit is (dev: G0 G1 G2 G3 G4 G4b G5 G6 G6b G7 G8;
    # main: G0 G1 M1 M2 M3)
    "98d8c56dbd": "G0",
    "274e04d21f": "G0",
    "5c613abf4e": "G1",
    "cde56a4692": "G2",
    "2d6e946bab": "G3",
    "959a542a11": "G4",
    "7f9175207d": "G4b",
    "bfa33263ca": "G5",
    "1392f28a5a": "G6",
    "3f49de20de": "G6b",
    "d48bd6be0a": "G7",
    "574e04ebf8": "G1",
    "c452d5a7ee": "M1",
    "a9381be598": "M2",
}
COMPARED_CAPABILITIES = (
    "scheduler_module",
    "scheduler_names",
    "registry_key",
    "wrap_params",
    "fetch_params",
    "fetch_arity",
    "dynamic_cp_group_getter",
    "has_resolve_cp_group",
    "has_route_prebuilder",
    "packed_seq_params_fields",
    "init_cp_keywords",
    "features",
)


def declaring_adapter(generation: str) -> str:
    """The adapter that declares ``generation``, else the terminal UnsupportedAdapter."""
    return next((cls.__name__ for cls in ADAPTERS if generation in cls.generations()), UnsupportedAdapter.__name__)


def fake_capabilities(generation: str) -> dict[str, Any]:
    """``detect()`` of the fake built for ``generation``, JSON-normalised like the doctor's record."""
    family = next(family for family, gen in FAKE_GENERATIONS if gen == generation)
    with installed(family.build(generation)):
        return json.loads(json.dumps(mcore_compat.detect().as_dict()))


def assert_detected(root: Path, generation: str) -> dict[str, Any]:
    status, report = doctor_report(root, cwd=root)
    caps = report["capabilities"]
    assert report["generation"] == generation, f"{root}: import_error={caps['import_error']}"
    assert report["adapter"] == declaring_adapter(generation)
    assert status == (0 if report["runnable"] else 1)
    assert caps["mcore_path"] == str((root / "megatron" / "core").resolve())
    return report


@pytest.mark.parametrize(
    ("generation", "commit"), FIRST_COMMITS_AND_G1_ON_DEV, ids=[f"{g}-{c}" for g, c in FIRST_COMMITS_AND_G1_ON_DEV]
)
def test_first_commit_detects_its_generation(generation: str, commit: str) -> None:
    report = assert_detected(tree(commit), generation)
    fake = fake_capabilities(generation)
    real = report["capabilities"]
    assert {k: real[k] for k in COMPARED_CAPABILITIES} == {k: fake[k] for k in COMPARED_CAPABILITIES}
    assert set(real["packing_config_fields"]) == set(fake["packing_config_fields"])


SCHEDULER_COMMITS = scheduler_commits()


@pytest.mark.parametrize(("generation", "commit"), SCHEDULER_COMMITS, ids=[f"{g}-{c}" for g, c in SCHEDULER_COMMITS])
def test_every_commit_that_touched_the_scheduler_detects_its_generation(generation: str, commit: str) -> None:
    """Between two first commits nothing changes shape: a commit that touched the scheduler's files and is detected
    otherwise than its newest first-commit ancestor's generation is a generation the table lacks."""
    assert_detected(tree(commit), generation)


@pytest.mark.parametrize("commit", PREVIOUS_GENERATION, ids=[f"{c}^" for c in PREVIOUS_GENERATION])
def test_parent_of_first_commit_is_the_previous_generation(commit: str) -> None:
    assert_detected(tree(f"{commit}^"), PREVIOUS_GENERATION[commit])


@pytest.mark.parametrize("branch", TIPS)
def test_branch_tip(branch: str) -> None:
    commit, generation = TIPS[branch]
    report = assert_detected(tree(commit), generation)
    assert report["runnable"], "both tips run dp_balanced natively"
    by_request = {(row["scheduler"], row["dynamic_cp"]): row["runnable"] for row in report["schedulers"]}
    assert by_request[("default_dynamic_cp", True)] is (branch == "dev")


MODEL_PARTS = {
    "mla": {"multi_latent_attention": True},
    "mtp": {"mtp_num_layers": 1},
    "moe_aux_loss": {"num_moe_experts": 8},
    "mamba": {"is_hybrid_model": True},
}
"""A model config field that switches each model part on."""
KEEPS_STATIC_CP_GROUP = {
    **dict.fromkeys(("G1", "G2", "G3", "M1", "M2", "M3"), set(MODEL_PARTS)),
    "G4": {"mla", "moe_aux_loss"},
    "G4b": {"moe_aux_loss"},
    **dict.fromkeys(("G5", "G6", "G6b", "G7", "G8"), set()),
}
"""The model parts whose code runs a dynamic-CP bin on the static CP group, per generation (docs/user-guide.md;
for dynamic CP: on dev MTP and Mamba follow the bin's group from G4, MLA from G4b, MoE aux loss from G5; the
releases and main follow with none)."""
_REFUSALS = """
import json, types
from mcore_compat.adapters import adapter
parts = json.loads({parts!r})
refused = []
for name, fields in parts.items():
    config = types.SimpleNamespace(
        sequence_packing_scheduler="default_dynamic_cp", dynamic_context_parallel=True, **fields
    )
    if adapter().config_refusal(config, "default_dynamic_cp") is not None:
        refused.append(name)
print(json.dumps(refused))
"""


@pytest.mark.parametrize(("generation", "commit"), FIRST_COMMITS, ids=[f"{g}-{c}" for g, c in FIRST_COMMITS])
def test_dynamic_cp_refuses_the_model_parts_that_keep_the_static_cp_group(generation: str, commit: str) -> None:
    """What the config check (and so validation and every step, native or portable) refuses under dynamic CP."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (tree(commit), PROJECT))), "OMP_NUM_THREADS": "1"}
    script = _REFUSALS.format(parts=json.dumps(MODEL_PARTS))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert set(json.loads(proc.stdout.splitlines()[-1])) == KEEPS_STATIC_CP_GROUP[generation]
