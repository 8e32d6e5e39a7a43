"""``mcore-compat plan``: the JSON plan's invariants, every input source, and one-sentence errors (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcore_compat import cli
from mcore_compat.plan import Layout, alignment, plan_lengths
from packing.global_batch import alignment_multiple


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(["plan", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def _check_json_plan(data: dict, lengths: list[int], layout: tuple[int, int, int], m: int, sp: bool = False) -> None:
    """The issue's contract, checked from the input lengths alone (not from the planner's own figures)."""
    tp, cp, dp = layout
    multiple = alignment_multiple(dynamic_cp=False, dp=dp, cp=cp, tp=tp, sequence_parallel=sp)
    padded = [-(-n // multiple) * multiple for n in lengths]
    bins = data["bins"]
    assert data["microbatches"] == len(bins)
    assert all(len(row) == dp for row in bins), "every DP rank has the same number of microbatches"
    members = sorted(s for row in bins for b in row for s in b)
    assert members == list(range(len(lengths))), "every input line exactly once"
    for row in bins:
        for b in row:
            assert b, "no empty bin"
            assert sum(padded[s] for s in b) <= m * cp, "no bin over M x CP padded tokens"


@pytest.mark.parametrize("scheduler", ["dp_balanced", "balanced"])
@pytest.mark.parametrize(("layout", "sp"), [((1, 1, 4), False), ((1, 2, 2), False), ((2, 4, 2), True)])
def test_json_plan_from_a_lengths_file(tmp_path, capsys, scheduler, layout, sp):
    lengths = [1, 7, 130, 64, 1000, 3, 33, 512, 257, 900, 5, 77, 1020, 1, 1, 96, 300, 44]
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    argv = ["--lengths", str(path), "--layout", ",".join(map(str, layout)), "--max-seqlen-per-dp-cp-rank", "1024"]
    argv += ["--scheduler", scheduler, "--json"] + (["--sequence-parallel"] if sp else [])
    status, out, _ = _plan(capsys, *argv)
    assert status == 0
    _check_json_plan(json.loads(out), lengths, layout, 1024, sp)


def test_balanced_never_needs_more_microbatches_than_dp_balanced(capsys):
    for seed in range(6):
        argv = ["--synthetic", "chat-sft", "--samples", "512", "--seed", str(seed), "--layout", "1,2,8"]
        status, out, _ = _plan(capsys, *argv, "--max-seqlen-per-dp-cp-rank", "2048", "--json")
        assert status == 0
        data = json.loads(out)
        count = {s["scheduler"]: s["microbatches"] for s in data["schedulers"]}
        assert count["balanced"] <= count["dp_balanced"]
        assert data["microbatches"] == count["dp_balanced"], "the first scheduler's plan is the top-level one"
        for report in data["schedulers"]:
            _check_json_plan(
                {"microbatches": report["microbatches"], "bins": report["bins"]}, _raw(data), (1, 2, 8), 2048
            )


def _raw(data: dict) -> list[int]:
    # synthetic lengths are not echoed; at CP 2 the padded length is a valid raw length for the check
    return data["padded"]


def test_human_output_compares_the_schedulers(capsys):
    argv = ["--synthetic", "lognormal", "--samples", "256", "--layout", "1,1,4", "--max-seqlen-per-dp-cp-rank", "8192"]
    status, out, _ = _plan(capsys, *argv, "--scheduler", "dp_balanced", "--scheduler", "balanced")
    assert status == 0
    for text in ("lower bound:", "dp_balanced:", "balanced:", "DP efficiency", "attention-work imbalance", "padding"):
        assert text in out


@pytest.mark.parametrize(("layout", "min_size"), [((1, 2, 2), 1), ((1, 1, 8), 2), ((2, 4, 4), 4)])
def test_default_dynamic_cp_plan(tmp_path, capsys, layout, min_size):
    """Dynamic CP: bins over DP x CP ranks, each group on a power-of-two number of ranks that share its bin."""
    tp, cp, dp = layout
    pool, m = dp * cp, 512
    lengths = [((7 * i * i + 13 * i) % (m * pool - 2 * pool)) + 1 for i in range(60)]
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)))
    argv = ["--lengths", str(path), "--layout", f"{tp},{cp},{dp}", "--max-seqlen-per-dp-cp-rank", str(m)]
    argv += ["--scheduler", "default_dynamic_cp", "--min-dynamic-context-parallel-size", str(min_size), "--json"]
    status, out, err = _plan(capsys, *argv)
    assert status == 0, err
    (report,) = json.loads(out)["schedulers"]
    multiple = alignment_multiple(dynamic_cp=True, dp=dp, cp=cp, tp=tp, sequence_parallel=False)
    padded = [-(-n // multiple) * multiple for n in lengths]
    assert report["padded"] == padded
    seen = []
    for bins, sizes in zip(report["bins"], report["cp_sizes"], strict=True):
        assert len(bins) == len(sizes) == pool
        rank = 0
        while rank < pool:
            size = sizes[rank]
            assert size >= min_size and size & (size - 1) == 0
            group = bins[rank : rank + size]
            assert all(b == group[0] for b in group) and group[0], "a group's ranks run one non-empty bin"
            assert sum(padded[s] for s in group[0]) <= m * size, "no rank over max_seqlen_per_dp_cp_rank"
            seen += group[0]
            rank += size
    assert sorted(seen) == list(range(len(lengths))), "every sample exactly once"


def test_human_output_names_dynamic_cp_group_sizes(capsys):
    argv = ["--synthetic", "uniform", "--samples", "64", "--layout", "1,2,2", "--max-seqlen-per-dp-cp-rank", "512"]
    status, out, _ = _plan(capsys, *argv, "--scheduler", "default_dynamic_cp")
    assert status == 0
    assert "default_dynamic_cp:" in out and "dynamic CP group sizes:" in out


@pytest.mark.parametrize(
    ("text", "extra", "message"),
    [
        ("4\n12\nx7\n", [], "line 3: 'x7' is not an integer"),
        ("4\n0\n", [], "line 2: length 0 is not positive"),
        ("4\n-3\n", [], "line 2: length -3 is not positive"),
        ("4\n8\n2049\n", [], "line 3 (sample 2): length 2049 (padded to 2052) exceeds the bin capacity 2048"),
        ("4\n8\n", ["--scheduler", "default_dynamic_cp", "--layout", "1,2,3"], "DP x CP = 6 must be a power of two"),
        ("4\n8\n", ["--layout", "1,2"], "write three positive integers TP,CP,DP"),
        ("4\n8\n", ["--scheduler", "dp_balancd"], "'dp_balancd' is not a scheduler plan knows"),
        ("", [], "the file has no lines"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_status_2(tmp_path, capsys, text, extra, message):
    path = tmp_path / "lengths.txt"
    path.write_text(text)
    layout = [] if "--layout" in extra else ["--layout", "1,2,2"]
    status, out, err = _plan(capsys, "--lengths", str(path), *layout, "--max-seqlen-per-dp-cp-rank", "1024", *extra)
    assert status == 2
    assert out == ""
    assert message in err, err
    assert err.count("\n") == 1, "one line"


def test_too_long_names_the_fix(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("4\n5000\n")
    status, _, err = _plan(capsys, "--lengths", str(path), "--layout", "1,4,2", "--max-seqlen-per-dp-cp-rank", "1000")
    assert status == 2
    assert "raise --max-seqlen-per-dp-cp-rank to at least 1250" in err


@pytest.mark.parametrize(("donates", "microbatches"), [(True, 1), (False, None)])
def test_dp_balanced_planned_with_the_pins_first_bin_rule(donates, microbatches):
    """Three short samples fit in one bin; DP 2 needs two: dev (and the portable backend) split the first bin,
    main never does, and its scheduler fails the step."""
    kwargs = {"layout": Layout(1, 1, 2), "max_seqlen_per_dp_cp_rank": 64, "schedulers": ["dp_balanced"]}
    _, (report,) = plan_lengths([8, 8, 8], first_bin_donates=donates, **kwargs)
    if microbatches is not None:
        assert report.microbatches == microbatches and report.unavailable is None
        return
    assert report.unavailable is not None
    assert report.unavailable.startswith("dp_balanced (as this pin's Megatron-Core runs it)")
    assert "use more samples per step" in report.unavailable


def test_a_scheduler_that_cannot_plan_is_named_while_the_others_print(tmp_path, capsys):
    """A sample too long for a static-CP bin fits a dynamic-CP one: the static schedulers say so under their
    names, default_dynamic_cp plans, exit status 1."""
    path = tmp_path / "lengths.txt"
    path.write_text("10\n200\n3000\n")
    names = ["dp_balanced", "default_dynamic_cp", "balanced"]
    argv = ["--lengths", str(path), "--layout", "1,2,2", "--max-seqlen-per-dp-cp-rank", "1024"]
    status, out, err = _plan(capsys, *argv, *(a for n in names for a in ("--scheduler", n)))
    assert status == 1 and err == ""
    for name in ("dp_balanced", "balanced"):
        assert f"{name}: cannot plan this batch: {path} line 3 (sample 2): length 3000" in out
    assert "default_dynamic_cp:\n  microbatches per step: 1" in out
    status, out, _ = _plan(capsys, *argv, "--scheduler", "balanced", "--scheduler", "default_dynamic_cp", "--json")
    data = json.loads(out)
    assert status == 1 and data["schedulers"][0]["scheduler"] == "balanced" and data["schedulers"][0]["unavailable"]
    assert data["microbatches"] == data["schedulers"][1]["microbatches"] == 1


def test_a_file_that_is_not_text_is_one_line(tmp_path, capsys):
    path = tmp_path / "lengths.bin"
    path.write_bytes(bytes(range(256)) * 4)
    status, out, err = _plan(capsys, "--lengths", str(path), "--layout", "1,1,2", "--max-seqlen-per-dp-cp-rank", "64")
    assert (status, out) == (2, "")
    assert (
        err == f"mcore-compat plan: --lengths {path}: not a text file; write one raw sample length per line (for a "
        "Megatron indexed dataset's .bin/.idx pass --megatron-dataset PREFIX)\n"
    )


def test_an_indexed_dataset_the_reader_cannot_parse_is_one_line(tmp_path):
    """Through a fresh interpreter: the reader's failing ``__del__`` would print a traceback at teardown."""
    pytest.importorskip("megatron.core.datasets.indexed_dataset")
    prefix = tmp_path / "broken"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"broken{suffix}").write_bytes(b"\x00\xff not an index" * 8)
    argv = ["--megatron-dataset", str(prefix), "--layout", "1,1,2", "--max-seqlen-per-dp-cp-rank", "64"]
    result = subprocess.run(
        [sys.executable, "-m", "mcore_compat", "plan", *argv], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"mcore-compat plan: --megatron-dataset {prefix}: Megatron-Core's reader cannot")
    assert result.stderr.count("\n") == 1, result.stderr


def test_alignment_is_the_runtime_rule():
    for tp in (1, 2, 4, 8):
        for cp in (1, 2, 4, 8):
            for sp in (False, True):
                expected = alignment_multiple(dynamic_cp=False, dp=1, cp=cp, tp=tp, sequence_parallel=sp)
                assert alignment(Layout(tp, cp, 1), sp) == expected


def test_megatron_indexed_dataset_through_mcores_reader(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import numpy

    lengths = [5, 300, 17, 1024, 64, 2, 900, 33]
    prefix = str(tmp_path / "tiny")
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
    for n in lengths:
        builder.add_item(torch.arange(n, dtype=torch.int32))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    argv = ["--megatron-dataset", prefix, "--layout", "1,1,2", "--max-seqlen-per-dp-cp-rank", "1024", "--json"]
    status, out, _ = _plan(capsys, *argv)
    assert status == 0
    data = json.loads(out)
    assert data["padded"] == lengths
    _check_json_plan(data, lengths, (1, 1, 2), 1024)
    status, _, err = _plan(
        capsys,
        "--megatron-dataset",
        str(tmp_path / "missing"),
        "--layout",
        "1,1,2",
        "--max-seqlen-per-dp-cp-rank",
        "1024",
    )
    assert status == 2 and "missing.bin does not exist" in err


def test_plot_needs_matplotlib_or_writes_the_png(tmp_path, capsys):
    target = tmp_path / "plan.png"
    argv = ["--synthetic", "bimodal", "--samples", "128", "--layout", "1,1,4", "--max-seqlen-per-dp-cp-rank", "4096"]
    status, _, err = _plan(capsys, *argv, "--plot", str(target))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert os.environ.get("MCORE_COMPAT_EXPECT_PIN") != "core_r0.16", "that session installs the plot extra"
        assert status == 2 and "needs matplotlib" in err and "mcore-compat[plot]" in err
        return
    assert status == 0 and target.stat().st_size > 0


def test_python_dash_m_runs_plan(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("3\n5\n8\n13\n")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mcore_compat",
            "plan",
            "--lengths",
            str(path),
            "--layout",
            "1,1,2",
            "--max-seqlen-per-dp-cp-rank",
            "16",
            "--scheduler",
            "balanced",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["microbatches"] == 1
