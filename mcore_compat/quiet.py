"""The known noise of the libraries mcore-compat's commands import, hidden unless ``--verbose`` asks for it.

Importing Megatron-Core warns about every optional dependency it lacks (Transformer Engine, Apex, ...) and its rerun
state machine logs its own implicit start. A command's user asked about packing, not about those: the CLI, the demo
and the ranks of :func:`mcore_compat.testing.launch` hide them. A trainer importing :mod:`packing` is never touched.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LIBRARIES", "LOGGERS", "hide_library_noise", "library_noise_hidden"]

LIBRARIES: tuple[str, ...] = ("megatron", "transformer_engine", "apex", "modelopt", "nvidia_resiliency_ext")
"""Top-level packages whose warnings and log records below ERROR the commands hide."""
LOGGERS: tuple[str, ...] = (*LIBRARIES, "torch.utils.cpp_extension")
"""Loggers the commands quiet below ERROR: the libraries', and torch's extension builder, which Megatron-Core imports
and which logs "No CUDA runtime is found" under a CUDA build of torch without a GPU."""


def hide_library_noise() -> None:
    """Ignore warnings raised from :data:`LIBRARIES`, torch.distributed's deprecation warnings (Megatron-Core calls
    functions torch deprecates; this project's own code names none: ``tests/test_no_deprecations.py``) and the
    records below ERROR of :data:`LOGGERS`, in this process."""
    module = r"({})(\..*)?$".format("|".join(LIBRARIES))
    warnings.filterwarnings("ignore", module=module)
    for category in (FutureWarning, DeprecationWarning):  # torch.distributed's, for calls Megatron-Core makes
        warnings.filterwarnings("ignore", category=category, module=r"torch\.distributed(\..*)?$")
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


@contextmanager
def library_noise_hidden(hide: bool = True) -> Iterator[None]:
    """:func:`hide_library_noise` for the duration (nothing when ``hide`` is False); then as before."""
    levels = {name: logging.getLogger(name).level for name in LOGGERS}
    with warnings.catch_warnings():
        if hide:
            hide_library_noise()
        try:
            yield
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
