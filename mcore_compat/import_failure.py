"""One line for a Megatron-Core that fails to import: what raised, where, and the likely cause when it is known."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePath

__all__ = ["KNOWN_CAUSES", "KnownCause", "describe_import_failure"]

Frames = Sequence[traceback.FrameSummary]


@dataclass(frozen=True)
class KnownCause:
    """A failure seen in the field: how to recognise it and what to tell the user."""

    name: str
    matches: Callable[[BaseException, Frames], bool]
    advice: str


def _raised_in(frames: Frames, *tail: str) -> bool:
    return any(PurePath(frame.filename).parts[-len(tail) :] == tail for frame in frames)


KNOWN_CAUSES: tuple[KnownCause, ...] = (
    KnownCause(
        "triton missing",
        lambda exc, frames: isinstance(exc, ModuleNotFoundError) and exc.name == "triton",
        "megatron-core 0.18 and later import triton unconditionally; pip install triton",
    ),
    KnownCause(
        "CUDA extension without a GPU",
        lambda exc, frames: _raised_in(frames, "torch", "utils", "cpp_extension.py"),
        "Megatron-Core builds a CUDA extension while it is imported, and this torch sees no GPU to build for (a CUDA "
        "build of torch on a machine without one); run where a GPU is visible, set TORCH_CUDA_ARCH_LIST (e.g. 9.0) "
        "to build without one, or install torch's CPU build",
    ),
)
"""The import failures whose cause is known, in the order they are tried."""


def _where(frame: traceback.FrameSummary) -> str:
    """``package/.../file.py:line``: the path from the last ``site-packages`` on, else as it is."""
    parts = PurePath(frame.filename).parts
    start = max((i + 1 for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")), default=0)
    return f"{PurePath(*parts[start:])}:{frame.lineno}"


def describe_import_failure(exc: BaseException) -> str:
    """``Type: message (raised at file:line, importing megatron/...:line; likely cause: advice)``, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    notes = []
    if frames:
        notes.append(f"raised at {_where(frames[-1])}")
        ours = [frame for frame in frames if "megatron" in PurePath(frame.filename).parts]
        if ours and ours[-1] is not frames[-1]:
            notes.append(f"while importing {_where(ours[-1])}")
    cause = next((known for known in KNOWN_CAUSES if known.matches(exc, frames)), None)
    if cause is not None:
        notes.append(f"likely cause: {cause.advice}")
    return f"{text} ({'; '.join(notes)})" if notes else text
