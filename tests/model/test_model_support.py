"""enable_dynamic_cp_model_support, its source introspection and dynamic_cp_model_refusal (fast, no ranks).

The attention switch is exercised on stand-ins here and on the pin's real ``SelfAttention`` in
``test_rope_dynamic_cp.py``. With ``MCORE_REPO`` (a Megatron-LM git repository) the introspection
is also run on every generation's first commit, both tips and the release tags, and must agree
with the generation table.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mcore_compat import model_support
from mcore_compat.generations import GENERATIONS, MODEL_COMPONENTS
from mcore_compat.model_support import (
    NO_CP_GROUP,
    _follow_microbatch_group,
    dynamic_cp_model_refusal,
    model_components_following_in_source,
)

PROJECT = Path(__file__).resolve().parents[2]
REPO = os.environ.get("MCORE_REPO")

RELEASE_SOURCE = {
    "megatron.core.transformer.attention": """
class Attention:
    def forward(self, hidden_states, packed_seq_params=None):
        return apply_rotary_pos_emb(hidden_states, cp_group=self.pg_collection.cp)
""",
    "megatron.core.extensions.transformer_engine": """
class TEDotProductAttention:
    def __init__(self, config):
        if config.context_parallel_size > 1:
            TEDotProductAttention.cp_stream = torch.cuda.Stream()
    def forward(self, packed_seq_params=None):
        if packed_seq_params.cp_group is not None:
            self.cp_group = packed_seq_params.cp_group
""",
    "megatron.core.transformer.multi_token_prediction": "def roll(t, cp_group): return t\n",
}
DEV_SOURCE = {
    "megatron.core.transformer.attention": """
class Attention:
    def forward(self, hidden_states, packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.local_cp_size is not None:
            self.pg_collection.cp = packed_seq_params.cp_group
""",
    "megatron.core.extensions.transformer_engine": """
class TEDotProductAttention:
    def forward(self, packed_seq_params=None):
        if TEDotProductAttention.cp_stream is None:
            TEDotProductAttention.cp_stream = torch.cuda.Stream()
""",
    "megatron.core.transformer.multi_token_prediction": """
from megatron.core.packed_seq_params import resolve_cp_group
def layer(self, packed_seq_params):
    return resolve_cp_group(self.cp_group, packed_seq_params)
""",
}


def test_introspection_tells_the_release_shape_from_dev() -> None:
    assert model_components_following_in_source(RELEASE_SOURCE.get) == ()
    assert model_components_following_in_source(DEV_SOURCE.get) == ("attention", "te_cp_stream", "mtp")


def test_introspection_reads_only_the_named_method() -> None:
    source = {
        "megatron.core.transformer.attention": """
class Attention:
    def forward(self, packed_seq_params=None):
        return None
    def other(self, packed_seq_params):
        return packed_seq_params.cp_group
"""
    }
    assert model_components_following_in_source(source.get) == ()


def _git_reader(commit: str) -> Any:
    def read(module: str) -> str | None:
        path = module.replace(".", "/") + ".py"
        proc = subprocess.run(
            ["git", f"--git-dir={REPO}", "show", f"{commit}:{path}"], capture_output=True, text=True, check=False
        )
        return proc.stdout if proc.returncode == 0 else None

    return read


REAL_COMMITS = [
    *((gen.id, gen.first_commit) for gen in GENERATIONS.values() if gen.first_commit),
    ("G1", "274e04d21f"),
    *(("G1", f"core_v{v}") for v in ("0.16.1", "0.17.1", "0.18.2", "0.19.0")),
    ("M3", "d98e8a64dd"),
]


@pytest.mark.skipif(REPO is None, reason="MCORE_REPO is unset: point it at a Megatron-LM git repository")
@pytest.mark.parametrize(("generation", "commit"), REAL_COMMITS, ids=[f"{g}-{c}" for g, c in REAL_COMMITS])
def test_generation_table_matches_the_real_source(generation: str, commit: str) -> None:
    found = model_components_following_in_source(_git_reader(commit))
    assert found == GENERATIONS[generation].model_follows_microbatch_cp_group


class _Group:
    def __init__(self, name: str, size: int) -> None:
        self.name, self._size = name, size

    def size(self) -> int:
        return self._size


class _StandInTE:
    """Transformer Engine's attention as far as the switch touches it: a class-level stream and a CP group."""

    cp_stream: Any = None

    def __init__(self, group: Any) -> None:
        self.cp_group, self.cp_global_ranks, self.cp_comm_type = group, [0, 1], "p2p"
        self.calls: list[tuple[Any, ...]] = []

    def set_context_parallel_group(self, group: Any, ranks: Any, stream: Any, comm_type: str) -> None:
        self.calls.append((group, ranks, stream, comm_type))
        self.cp_group, self.cp_global_ranks = group, ranks


class _StandInAttention:
    def __init__(self, static: Any, context_parallel_size: int = 2, core: Any = None) -> None:
        self.pg_collection = SimpleNamespace(cp=static)
        self.config = SimpleNamespace(context_parallel_size=context_parallel_size)
        self.core_attention = core
        self.seen: list[Any] = []

    def forward(self, hidden_states: Any, attention_mask: Any = None, packed_seq_params: Any = None) -> Any:
        self.seen.append(self.pg_collection.cp)
        if self.core_attention is not None and getattr(packed_seq_params, "cp_group", None) is not None:
            self.core_attention.cp_group = packed_seq_params.cp_group  # TE's wrapper switches itself
        if hidden_states == "raise":
            raise RuntimeError("boom")
        return hidden_states


def _psp(local_cp_size: int | None, group: Any = None) -> SimpleNamespace:
    return SimpleNamespace(local_cp_size=local_cp_size, cp_group=group)


@pytest.fixture
def attention_cls(monkeypatch: pytest.MonkeyPatch) -> type:
    streams = iter(range(100))
    monkeypatch.setattr(model_support, "_new_cp_stream", lambda: f"stream{next(streams)}")
    monkeypatch.setattr(_StandInTE, "cp_stream", None)

    class Patched(_StandInAttention):
        pass

    Patched.forward = _follow_microbatch_group(_StandInAttention.forward, create_stream=True)  # type: ignore[method-assign]
    return Patched


def test_runs_on_the_microbatch_group_and_restores_the_static_one(attention_cls: type) -> None:
    static, dynamic = _Group("static", 2), _Group("dynamic", 4)
    attention = attention_cls(static)
    attention.forward("x", None, packed_seq_params=_psp(4, dynamic))
    attention.forward("x", None, _psp(4, dynamic))  # positional
    attention.forward("x", packed_seq_params=_psp(None))
    attention.forward("x")
    assert attention.seen == [dynamic, dynamic, static, static]
    assert attention.pg_collection.cp is static


def test_restores_the_static_group_when_the_forward_raises(attention_cls: type) -> None:
    static = _Group("static", 2)
    attention = attention_cls(static)
    with pytest.raises(RuntimeError, match="boom"):
        attention.forward("raise", packed_seq_params=_psp(2, _Group("dynamic", 2)))
    assert attention.pg_collection.cp is static


def test_a_bin_without_cp_runs_on_a_size_one_group(attention_cls: type) -> None:
    attention = attention_cls(_Group("static", 2))
    attention.forward("x", packed_seq_params=_psp(1))
    assert attention.seen == [NO_CP_GROUP]
    assert (NO_CP_GROUP.size(), NO_CP_GROUP.rank()) == (1, 0)


def test_a_multi_rank_bin_without_group_is_an_error_naming_the_fields(attention_cls: type) -> None:
    attention = attention_cls(_Group("static", 2))
    with pytest.raises(ValueError, match=r"local_cp_size=2 without packed_seq_params\.cp_group"):
        attention.forward("x", packed_seq_params=_psp(2))
    assert attention.seen == []


def test_te_stream_created_once_when_a_dynamic_group_arrives(attention_cls: type) -> None:
    core = _StandInTE(None)
    attention = attention_cls(_Group("static", 1), context_parallel_size=1, core=core)
    attention.forward("x", packed_seq_params=_psp(1))
    assert _StandInTE.cp_stream is None, "a bin without CP needs no CP stream"
    attention.forward("x", packed_seq_params=_psp(2, _Group("dynamic", 2)))
    attention.forward("x", packed_seq_params=_psp(4, _Group("dynamic", 4)))
    assert _StandInTE.cp_stream == "stream0"
    assert core.calls == [], "static CP 1: nothing to restore in TE"


def test_te_static_group_restored_after_a_dynamic_bin(attention_cls: type) -> None:
    static = _Group("static", 2)
    core = _StandInTE(static)
    _StandInTE.cp_stream = "static-stream"
    attention = attention_cls(static, context_parallel_size=2, core=core)
    attention.forward("x", packed_seq_params=_psp(4, _Group("dynamic", 4)))
    assert core.calls == [(static, [0, 1], "static-stream", "p2p")]
    assert _StandInTE.cp_stream == "static-stream"


def _run_in_fresh_interpreter(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PROJECT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=PROJECT,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_enable_is_idempotent_and_reports_what_it_changed() -> None:
    pytest.importorskip("megatron.core")
    out = _run_in_fresh_interpreter(
        """
        import packing
        from megatron.core.transformer.attention import Attention
        from megatron.core.packed_seq_params import PackedSeqParams
        from mcore_compat.model_support import model_components_following_microbatch_cp_group as following
        assert not packing.model_support_applied()
        original = Attention.forward
        first = packing.enable_dynamic_cp_model_support()
        patched = Attention.forward
        second = packing.enable_dynamic_cp_model_support()
        assert first == second and Attention.forward is patched and packing.model_support_applied()
        needed = "attention" not in following() and "local_cp_size" in PackedSeqParams.__dataclass_fields__
        assert (patched is not original) == needed, (first, following())
        print(len(first), needed)
        """
    )
    changes, needed = out.split()
    assert (int(changes) > 0) == (needed == "True")


CAPS = SimpleNamespace(
    dynamic_cp_group_getter="get_hybrid_data_context_parallel_groups",
    generation_info=GENERATIONS["G1"],
    describe=lambda: "G1 (megatron-core 0.16.1)",
)


@pytest.fixture
def release_pin(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(model_support, "model_components_following_microbatch_cp_group", lambda: ())

    def applied(value: bool) -> None:
        monkeypatch.setattr(model_support._STATE, "called", value)

    applied(False)
    return applied


def test_refused_until_model_support_is_applied(release_pin: Any) -> None:
    reason = dynamic_cp_model_refusal(CAPS)
    assert reason is not None and "enable_dynamic_cp_model_support()" in reason and "#6821" in reason
    release_pin(True)
    assert dynamic_cp_model_refusal(CAPS) is None
    assert dynamic_cp_model_refusal(CAPS, SimpleNamespace(num_moe_experts=None, mtp_num_layers=0)) is None


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ({"multi_latent_attention": True}, ("multi-latent attention", "#4226")),
        ({"mtp_num_layers": 1}, ("mtp_num_layers=1", "#7145")),
        ({"num_moe_experts": 8}, ("num_moe_experts=8", "#7146")),
        ({"is_hybrid_model": True}, ("Mamba", "#7143")),
        ({"experimental_attention_variant": "dsa"}, ("experimental_attention_variant='dsa'",)),
    ],
)
def test_components_the_pin_keeps_static_are_refused_even_with_support(
    release_pin: Any, config: dict[str, Any], names: tuple[str, ...]
) -> None:
    release_pin(True)
    reason = dynamic_cp_model_refusal(CAPS, SimpleNamespace(**config))
    assert reason is not None and reason.count(".") <= 3
    for name in names:
        assert name in reason
    assert "dp_balanced" in reason


def test_dev_needs_no_call_and_runs_every_component(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_support, "model_components_following_microbatch_cp_group", lambda: MODEL_COMPONENTS)
    monkeypatch.setattr(model_support._STATE, "called", False)
    caps = SimpleNamespace(
        dynamic_cp_group_getter="get_dynamic_data_context_parallel_groups",
        generation_info=GENERATIONS["G8"],
        describe=lambda: "G8",
    )
    config = SimpleNamespace(multi_latent_attention=True, mtp_num_layers=1, num_moe_experts=8, is_hybrid_model=True)
    assert dynamic_cp_model_refusal(caps, config) is None


def test_pins_without_dynamic_cp_groups_are_left_to_the_probe() -> None:
    caps = SimpleNamespace(dynamic_cp_group_getter=None, generation_info=GENERATIONS["G0"], describe=lambda: "G0")
    assert dynamic_cp_model_refusal(caps, SimpleNamespace(multi_latent_attention=True)) is None
