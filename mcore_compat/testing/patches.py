"""The CPU patches that let Megatron-Core's packing scheduler and schedules run on gloo without a GPU (P1-P7).

:func:`cpu_patches` applies only the patches a run needs and restores everything on exit; nothing
here is active unless a caller enters it.

| # | patch | applied |
|---|---|---|
| P1 | stand-in ``triton`` module | only if ``import megatron.core`` fails for want of triton |
| P2 | ``torch.cuda.current_device()`` returns the CPU device | always |
| P3 | ``Tensor.cuda()`` returns the tensor itself | always |
| P4 | ``torch.cuda.synchronize()`` is a no-op | dynamic CP (group warm-up) |
| P5 | ``torch.distributed.barrier`` drops ``device_ids`` | dynamic CP (group warm-up) |
| P6 | pure-torch THD zigzag partition in place of Transformer Engine's | CP slicing without TE |
| P7 | ``torch.zeros(..., device="cuda")`` allocates on the CPU (the schedules' token counter) | always |
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import torch
import torch.distributed as dist

from mcore_compat.generations import SCHEDULER_MODULE, SCHEDULER_UTILS_MODULE, TE_EXTENSIONS_MODULE
from mcore_compat.thd import thd_partitioned_indices

PartitionFn = Callable[[torch.Tensor, int, int, int], torch.Tensor]
_MISSING = object()


class _Patcher:
    """Set attributes and ``sys.modules`` entries, remembering how to undo each, in reverse order."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self.applied: list[str] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        old = target.__dict__.get(name, _MISSING) if isinstance(target, type) else getattr(target, name, _MISSING)
        setattr(target, name, value)
        self._undo.append(lambda: delattr(target, name) if old is _MISSING else setattr(target, name, old))

    def add_module(self, name: str, module: ModuleType) -> None:
        had, old = name in sys.modules, sys.modules.get(name)  # a None entry blocks the import; keep it
        sys.modules[name] = module

        def undo() -> None:
            if had:
                sys.modules[name] = cast(ModuleType, old)
            else:
                sys.modules.pop(name, None)

        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class _TritonStub:
    """Any attribute of the stand-in triton: a type (torch's flop counter uses them in ``isinstance``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self


def _jit(fn: Any = None, **kwargs: Any) -> Any:
    return fn if fn is not None else (lambda inner: inner)


def _stub_module(name: str) -> ModuleType:
    module = ModuleType(name)
    module.__dict__["jit"] = _jit
    module.__dict__["__version__"] = "0.0.0"  # Megatron-Core's own "no usable triton" (0.18+ parse it on import)
    module.__dict__["__getattr__"] = _stub_attribute
    return module


def _stub_attribute(attr: str) -> type:
    # Dunder names stay missing: inspect.getmodule() reads __file__ of every module in sys.modules.
    if attr.startswith("__") and attr.endswith("__"):
        raise AttributeError(attr)
    return type(attr, (_TritonStub,), {})


def _zeros_on_cpu(zeros: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.zeros`` that puts a ``device="cuda"`` allocation (Megatron-Core's schedules count tokens in one)
    on the CPU."""

    def cpu_zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return zeros(*args, **kwargs)

    return cpu_zeros


def _triton_stand_in_needed() -> bool:
    """Whether ``import megatron.core`` fails only for want of triton (0.18+, main and dev without triton).

    Elsewhere (no triton and a pin that does not import it: 0.13-0.17) a stand-in would make torch believe
    triton is installed and import ``triton.backends``.
    """
    try:
        importlib.import_module("triton")
        return False
    except ImportError:
        pass
    try:
        importlib.import_module("megatron.core")
    except ImportError as exc:
        return exc.name == "triton"
    return False


def _apply_triton_stub(patcher: _Patcher) -> None:
    triton = _stub_module("triton")
    language = _stub_module("triton.language")
    triton.__dict__["language"] = language
    patcher.add_module("triton", triton)
    patcher.add_module("triton.language", language)
    patcher.applied.append("P1 stand-in triton")


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _same_tensor(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _no_sync(device: Any = None) -> None:
    return None


def _barrier_without_device_ids(original: Callable[..., Any]) -> Callable[..., Any]:
    def barrier(*args: Any, device_ids: Any = None, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    return barrier


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _apply_partition(patcher: _Patcher, partition: PartitionFn) -> None:
    """Replace TE's THD partition wherever this pin calls it, found by attribute presence."""
    schedule = _import(SCHEDULER_MODULE)
    if schedule is not None and hasattr(schedule, "tex"):
        patcher.setattr(schedule, "tex", SimpleNamespace(thd_get_partitioned_indices=partition))
        patcher.applied.append(f"P6 {SCHEDULER_MODULE}.tex.thd_get_partitioned_indices")
    # dev: Transformer Engine's partition wrapper, imported by name into the utils (which import its module), and
    # looked up in its module when G5's THD padding runs
    for module in (_import(SCHEDULER_UTILS_MODULE), sys.modules.get(TE_EXTENSIONS_MODULE)):
        if module is not None and hasattr(module, "get_thd_partitioned_indices"):
            patcher.setattr(module, "get_thd_partitioned_indices", partition)
            patcher.applied.append(f"P6 {module.__name__}.get_thd_partitioned_indices")
    # The portable backend also runs on native pins (schedulers their registry lacks, dynamic CP on main).
    portable = importlib.import_module("mcore_compat.portable.microbatch")
    patcher.setattr(portable, "thd_partitioned_indices", partition)
    patcher.applied.append("P6 mcore_compat.portable.microbatch.thd_partitioned_indices (portable backend)")


def transformer_engine_available() -> bool:
    """Whether Transformer Engine is importable (then P6 is left out unless a partition is forced)."""
    return importlib.util.find_spec("transformer_engine") is not None


@contextmanager
def cpu_patches(
    *, context_parallel: bool = False, dynamic_cp: bool = False, partition: PartitionFn | None = None
) -> Iterator[tuple[str, ...]]:
    """Apply the CPU patches one run needs; yields their names, restores everything on exit.

    ``context_parallel``: some CP group is larger than 1 (static cp > 1); ``dynamic_cp``: dynamic
    CP groups are created and used. ``partition`` forces a THD partition function (negative
    controls); by default P6 uses :func:`mcore_compat.thd.thd_partitioned_indices` when TE is absent.
    """
    patcher = _Patcher()
    try:
        if _triton_stand_in_needed():
            _apply_triton_stub(patcher)
        patcher.setattr(torch.cuda, "current_device", _cpu_device)
        patcher.setattr(torch.Tensor, "cuda", _same_tensor)
        patcher.setattr(torch, "zeros", _zeros_on_cpu(torch.zeros))
        patcher.applied += ["P2 current_device -> cpu", "P3 Tensor.cuda no-op", "P7 zeros on cuda -> cpu"]
        if dynamic_cp:
            patcher.setattr(torch.cuda, "synchronize", _no_sync)
            patcher.setattr(dist, "barrier", _barrier_without_device_ids(dist.barrier))
            patcher.applied += ["P4 cuda.synchronize no-op", "P5 barrier without device_ids"]
        if (context_parallel or dynamic_cp) and (partition is not None or not transformer_engine_available()):
            _apply_partition(patcher, partition or thd_partitioned_indices)
        yield tuple(patcher.applied)
    finally:
        patcher.restore()


__all__ = [
    "PartitionFn",
    "cpu_patches",
    "transformer_engine_available",
]
