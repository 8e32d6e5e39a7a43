"""The CPU patches are active only inside the context, only where needed, and fully restored."""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

from mcore_compat.testing.patches import cpu_patches


def _originals() -> tuple[object, ...]:
    return (torch.cuda.current_device, torch.cuda.synchronize, dist.barrier, torch.zeros, "cuda" in vars(torch.Tensor))


def test_nothing_is_active_outside_the_context():
    before = _originals()
    with cpu_patches():
        assert torch.cuda.current_device() == torch.device("cpu")
        tensor = torch.ones(2)
        assert tensor.cuda() is tensor
    assert _originals() == before


@pytest.mark.parametrize(
    ("dynamic_cp", "patched"),
    [(False, {"P2", "P3", "P7"}), (True, {"P2", "P3", "P4", "P5", "P7"})],
)
def test_dynamic_cp_patches_only_with_dynamic_cp(dynamic_cp: bool, patched: set[str]):
    sync = torch.cuda.synchronize
    with cpu_patches(dynamic_cp=dynamic_cp) as applied:
        assert {name.split()[0] for name in applied} - {"P1", "P6"} == patched
        assert (torch.cuda.synchronize is not sync) == dynamic_cp
    assert torch.cuda.synchronize is sync


def test_zeros_asked_on_cuda_land_on_the_cpu():
    """Megatron-Core's schedules count tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``."""
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros([], dtype=torch.int, device="cuda")
    with cpu_patches():
        counter = torch.zeros([], dtype=torch.int, device="cuda")
        other = torch.zeros(2, device=torch.device("cuda", 0))
    assert counter.device.type == other.device.type == "cpu" and counter.dtype == torch.int


def test_barrier_drops_device_ids(monkeypatch: pytest.MonkeyPatch):
    calls = []
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: calls.append((args, kwargs)))
    with cpu_patches(dynamic_cp=True):
        dist.barrier(group="g", device_ids=[torch.device("cpu")])
    assert calls == [((), {"group": "g"})]


def test_restored_after_an_exception():
    before = _originals()
    with pytest.raises(RuntimeError, match="inside"), cpu_patches(dynamic_cp=True):
        raise RuntimeError("inside")
    assert _originals() == before


def _megatron_core_import(monkeypatch: pytest.MonkeyPatch, missing: str | None) -> None:
    """``import_module("megatron.core")`` fails for want of ``missing`` (None: it imports)."""
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> ModuleType:
        if name != "megatron.core":
            return real(name, package)
        if missing is not None:
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return ModuleType(name)

    monkeypatch.setattr(importlib, "import_module", import_module)


@pytest.mark.parametrize(
    ("triton", "megatron_core_missing", "stand_in"),
    [
        (None, "triton", True),  # 0.18+, main, dev without triton
        (None, None, False),  # 0.13-0.17 without triton: torch must keep seeing no triton
        (None, "megatron", False),  # no Megatron-Core at all
        (ModuleType("triton"), "triton", False),  # triton installed
    ],
)
def test_triton_stand_in_only_where_megatron_core_needs_it(
    triton: ModuleType | None, megatron_core_missing: str | None, stand_in: bool, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setitem(sys.modules, "triton", triton)
    _megatron_core_import(monkeypatch, megatron_core_missing)
    with cpu_patches() as applied:
        assert ("P1 stand-in triton" in applied) == stand_in
        assert (sys.modules["triton"] is not triton) == stand_in
    assert sys.modules["triton"] is triton


def test_triton_stand_in_behaves_like_triton_where_it_is_imported(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    _megatron_core_import(monkeypatch, "triton")
    with cpu_patches() as applied:
        import triton
        import triton.language as tl

        assert "P1 stand-in triton" in applied

        def kernel() -> None: ...

        assert triton.jit(kernel) is kernel
        assert triton.autotune(configs=[], key=[])(kernel) is kernel
        assert isinstance(triton.Config, type) and isinstance(tl.constexpr, type)
        assert not hasattr(triton, "__file__")  # inspect.getmodule() walks sys.modules (torch.library does)
        assert str(triton.__version__) == "0.0.0"  # 0.18+ parse it; below 3.4.0 on CPU they fall back to no triton
        assert inspect.getmodule(kernel) is sys.modules[__name__]
    assert sys.modules["triton"] is None
