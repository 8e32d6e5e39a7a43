"""``mcore-compat doctor`` exit status and ``--json`` output, in fresh interpreters."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import doctor_report, run_doctor

MCORE_SRC = os.environ.get("MCORE_SRC")


@pytest.fixture
def no_megatron_core(tmp_path: Path) -> Path:
    """A PYTHONPATH entry whose ``megatron`` package has no ``core``, shadowing any installed megatron-core."""
    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("")
    return tmp_path


def test_exit_1_when_nothing_can_run(no_megatron_core: Path) -> None:
    status, report = doctor_report(no_megatron_core)
    assert status == 1
    assert report["generation"] is None and report["runnable"] is False
    assert report["adapter"] == "UnsupportedAdapter"
    assert report["capabilities"]["import_error"] == "megatron-core is not installed"
    assert all(row["reason"] and "megatron-core is not installed" in row["reason"] for row in report["schedulers"])


def test_text_and_json_agree_on_exit_status(no_megatron_core: Path) -> None:
    text = run_doctor(no_megatron_core, as_json=False)
    assert text.returncode == 1
    assert "Megatron-Core generation: none" in text.stdout
    assert "global-batch packing: NOT available" in text.stdout


@pytest.mark.skipif(
    MCORE_SRC is None, reason="MCORE_SRC is unset: point it at a Megatron-LM checkout (e.g. /work/mlm/dev)"
)
def test_exit_0_on_a_dev_or_main_checkout() -> None:
    assert MCORE_SRC is not None
    status, report = doctor_report(Path(MCORE_SRC))
    assert status == 0
    assert report["runnable"] is True
    assert report["adapter"] != "UnsupportedAdapter"
    assert report["capabilities"]["mcore_path"] == str((Path(MCORE_SRC) / "megatron" / "core").resolve())
    runnable = {(row["scheduler"], row["dynamic_cp"]) for row in report["schedulers"] if row["runnable"]}
    assert ("dp_balanced", False) in runnable
