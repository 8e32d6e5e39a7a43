"""The cost model: its linear term is six FLOPs per parameter per token (counted from real torch layers of the
model's sizes), its quadratic term causal attention's ``6·layers·heads·kv_channels``; ``plan`` reports it."""

from __future__ import annotations

import json

import pytest
import torch

from mcore_compat import cli
from mcore_compat.cost import MODELS, CostModel, CostModelError, ModelSizes, parse_model
from mcore_compat.plan import Layout, plan_lengths


def _parameters(sizes: ModelSizes) -> int:
    """Parameters of the dense layers and the output layer, counted on torch modules of these sizes (no biases)."""
    h, q = sizes.hidden_size, sizes.num_attention_heads * sizes.kv_channels
    kv = sizes.num_query_groups * sizes.kv_channels
    ffn = sizes.ffn_hidden_size
    with torch.device("meta"):
        layer = [torch.nn.Linear(h, q + 2 * kv, bias=False), torch.nn.Linear(q, h, bias=False)]
        layer += [torch.nn.Linear(h, ffn * (2 if sizes.gated_linear_unit else 1), bias=False)]
        layer += [torch.nn.Linear(ffn, h, bias=False)]
        head = torch.nn.Linear(h, sizes.vocab_size, bias=False) if sizes.vocab_size else None
    per_layer = sum(p.numel() for module in layer for p in module.parameters())
    return sizes.num_layers * per_layer + (sum(p.numel() for p in head.parameters()) if head else 0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_six_flops_per_parameter_and_token_plus_causal_attention(name: str) -> None:
    sizes = MODELS[name]
    model = CostModel.of(sizes)
    assert model.linear == 6 * _parameters(sizes)
    assert model.quadratic == 6 * sizes.num_layers * sizes.num_attention_heads * sizes.kv_channels
    assert model.cost(1000) == model.linear * 1000 + model.quadratic * 1000**2


def test_llama3_8b_is_eight_billion_parameters_with_its_output_layer() -> None:
    assert 7.0e9 < _parameters(MODELS["llama3-8b"]) < 8.1e9  # 8.03e9 with the input embedding, not computed


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("llama3-8b", MODELS["llama3-8b"]),
        ("hidden=64,layers=2,heads=4", ModelSizes(64, 256, 2, 4, 4, 16)),
        (
            "hidden=64,layers=2,heads=4,groups=2,kv=32,ffn=100,glu,vocab=1000",
            ModelSizes(64, 100, 2, 4, 2, 32, True, 1000),
        ),
    ],
)
def test_named_or_given_sizes(text: str, expected: ModelSizes) -> None:
    assert parse_model(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("hidden=64", "give layers, heads"), ("layers=x", "'layers=x' is not"), ("gpt5", "'gpt5' is not")],
)
def test_bad_sizes_name_the_part(text: str, fragment: str) -> None:
    with pytest.raises(CostModelError, match=fragment):
        parse_model(text)


def test_sizes_from_a_config_with_megatron_cores_defaults() -> None:
    class Config:
        hidden_size, num_attention_heads, num_layers = 64, 4, 3
        ffn_hidden_size = num_query_groups = kv_channels = None

    assert ModelSizes.from_config(Config()) == ModelSizes(64, 256, 3, 4, 4, 16)


@pytest.mark.parametrize("scheduler", ["dp_balanced", "balanced", "default_dynamic_cp"])
@pytest.mark.parametrize("stages", [1, 4])
def test_no_plan_beats_its_lower_bound(scheduler: str, stages: int) -> None:
    lengths = [((i * 7919) % 3000) + 1 for i in range(300)]
    _, (report,) = plan_lengths(
        lengths, layout=Layout(1, 2, 4), max_seqlen_per_dp_cp_rank=2048, schedulers=[scheduler], pipeline_stages=stages
    )
    assert report.unavailable is None
    assert report.modeled_time >= report.modeled_bound > 0 and report.rank_spread >= 1.0


@pytest.mark.parametrize("scheduler", ["dp_balanced", "balanced", "default_dynamic_cp"])
@pytest.mark.parametrize("stages", [1, 4])
def test_per_rank_modeled_loads_hold_every_sample_once_and_give_the_step_time(scheduler: str, stages: int) -> None:
    """The loads --plot draws: each sample's a*L + b*L^2 (over the model's own sizes) spread over its group's ranks,
    every sample once; the step time is the busiest rank's total, or with stages the sum of each microbatch's
    busiest rank."""
    sizes = ModelSizes(64, 256, 2, 4, 4, 16)
    lengths = [((i * 7919) % 3000) + 1 for i in range(300)]
    padded, (report,) = plan_lengths(
        lengths,
        layout=Layout(1, 2, 4),
        max_seqlen_per_dp_cp_rank=2048,
        schedulers=[scheduler],
        cost=CostModel.of(sizes),
        pipeline_stages=stages,
    )
    sample = [6 * _parameters(sizes) * n + 6 * 2 * 4 * 16 * n * n for n in (report.padded or padded)]
    spread = 1 if report.cp_sizes is not None else 2  # static CP: every rank holds a bin's 1/CP share
    assert sum(map(sum, report.modeled_loads)) * spread == pytest.approx(sum(sample), rel=1e-9)
    rows = report.modeled_loads
    busiest = max(map(sum, zip(*rows, strict=True)))
    synchronised = stages > 1 or report.cp_sizes is not None
    assert report.modeled_time == pytest.approx(sum(map(max, rows)) if synchronised else busiest, rel=1e-12)


def test_plan_prints_and_writes_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--synthetic", "lognormal", "--samples", "256", "--layout", "1,2,4", "--max-seqlen-per-dp-cp-rank"]
    assert cli.main([*argv, "8192", "--model", "hidden=64,layers=2,heads=4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    sizes = parse_model("hidden=64,layers=2,heads=4")
    assert data["cost_model"] == {
        "model": "hidden=64,layers=2,heads=4",
        "linear": 6 * _parameters(sizes),
        "quadratic": 6 * 2 * 64,
    }
    assert all(s["modeled_time"] >= s["modeled_bound"] for s in data["schedulers"])
    assert cli.main([*argv, "8192"]) == 0
    assert "cost model (llama3-8b): " in capsys.readouterr().out
    assert cli.main([*argv, "8192", "--model", "nope"]) == 2
