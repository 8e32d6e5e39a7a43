"""Dynamic context parallelism on every pin: how to turn it on, its rules, and its DP x CP sub-groups.

Megatron-Core names the switch differently per generation (read from the pin, never from a version):
``initialize_model_parallel(hybrid_context_parallel=True)`` on releases 0.16.1-0.19.2 and ``main``,
``initialize_model_parallel(dynamic_context_parallel=True, min_dynamic_context_parallel_size=k)`` on
``dev``; the groups come from ``parallel_state.get_hybrid_data_context_parallel_groups`` or
``get_dynamic_data_context_parallel_groups`` (``capabilities.dynamic_cp_group_getter``).

The model config carries ``dynamic_context_parallel=True``. Where the pin's ``TransformerConfig`` has
no such field (releases, ``main``) set it after construction, with the scheduler and minimum size::

    config = TransformerConfig(...)          # hybrid_context_parallel stays False
    config.dynamic_context_parallel = True
    config.min_dynamic_context_parallel_size = 1
    config.sequence_packing_scheduler = "default_dynamic_cp"

The config's own ``hybrid_context_parallel`` must stay False there: Megatron-Core's
``forward_backward_no_pipelining`` would divert the step into its hybrid-CP path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from mcore_compat.capabilities import Capabilities
from mcore_compat.errors import UnsupportedPinError
from mcore_compat.rules import check_min_dynamic_cp_size, invalid_groups

__all__ = [
    "DYNAMIC_SCHEDULER",
    "dynamic_cp_group",
    "dynamic_cp_initialize_keywords",
    "first_dynamic_cp_pin",
    "model_refusal",
    "require_dynamic_cp_groups",
]

DYNAMIC_SCHEDULER = "default_dynamic_cp"
_INIT = "initialize_model_parallel"


def first_dynamic_cp_pin() -> str | None:
    """The first supported pin (pins.toml order) on which ``default_dynamic_cp`` runs."""
    from mcore_compat.pins import load

    wanted = f"{DYNAMIC_SCHEDULER}:dynamic"
    return next((name for name, pin in load().pins.items() if wanted in pin.runs), None)


def model_refusal(capabilities: Capabilities, model_config: Any = None) -> str | None:
    """Why the pin's model code would train a dynamic-CP bin wrong, or None.

    The model side lives in :mod:`mcore_compat.model_support`: on pins whose attention does not follow each
    microbatch's CP group, dynamic CP runs only once ``packing.enable_dynamic_cp_model_support()`` was called.
    """
    from mcore_compat.model_support import dynamic_cp_model_refusal

    return dynamic_cp_model_refusal(capabilities, model_config)


def dynamic_cp_initialize_keywords(capabilities: Capabilities, min_size: int = 1) -> dict[str, Any]:
    """The ``initialize_model_parallel`` keywords that create the pin's DP x CP sub-groups.

    Read from the pin's ``initialize_model_parallel`` signature: ``dynamic_context_parallel=True``
    (plus ``min_dynamic_context_parallel_size=min_size`` where it takes one), else
    ``hybrid_context_parallel=True``. Raises ``PackingConfigError`` for a ``min_size`` that is not a power of
    two, ``UnsupportedPinError`` on pins without such groups (both ``ValueError``).
    """
    check_min_dynamic_cp_size("min_size", min_size, None)
    accepted = capabilities.init_cp_keywords
    if "dynamic_context_parallel" in accepted:
        keywords: dict[str, Any] = {"dynamic_context_parallel": True}
        if "min_dynamic_context_parallel_size" in accepted:
            keywords["min_dynamic_context_parallel_size"] = min_size
        return keywords
    if "hybrid_context_parallel" in accepted:
        return {"hybrid_context_parallel": True}
    raise UnsupportedPinError(
        f"parallel_state.{_INIT} of {capabilities.describe()} takes no dynamic or hybrid context-parallel keyword, "
        "so it cannot create DP x CP sub-groups; dynamic context parallelism needs megatron-core 0.16.1 or later"
    )


def _getter(capabilities: Capabilities) -> Callable[..., Any]:
    name = capabilities.dynamic_cp_group_getter
    if name is None:
        raise UnsupportedPinError(f"{capabilities.describe()} has no DP x CP sub-group getter in parallel_state")
    getter: Callable[..., Any] = getattr(importlib.import_module("megatron.core.parallel_state"), name)
    return getter


def dynamic_cp_group(capabilities: Capabilities, size: int) -> Any:
    """The DP x CP sub-group of ``size`` ranks this rank belongs to, from the pin's getter; None for size 1."""
    if size == 1:
        return None
    return _getter(capabilities)(group_size=size)


def _init_hint(capabilities: Capabilities, min_size: int) -> str:
    try:
        keywords = dynamic_cp_initialize_keywords(capabilities, min_size)
    except ValueError:
        return "a pin with DP x CP sub-groups"
    spelled = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
    return f"parallel_state.{_INIT}(..., {spelled}) (packing.dynamic_cp_initialize_keywords() returns these keywords)"


def require_dynamic_cp_groups(capabilities: Capabilities, pool: int, min_size: int) -> None:
    """Raise ``PackingConfigError`` unless the pin holds a DP x CP sub-group of every size a bin may use.

    Sizes are the powers of two from ``max(2, min_size)`` to ``pool``. The check only reads
    ``parallel_state`` (no collective); a rank that raises here alone shares the error through the step's
    agreement (:func:`mcore_compat.agreement.fail_together`).
    """
    getter = _getter(capabilities)
    rank = importlib.import_module("torch.distributed").get_rank()
    size = max(2, min_size)
    while size <= pool:
        try:
            group = getter(group_size=size)
        except (KeyError, AssertionError):
            group = None
        ranks = _group_ranks(group)
        if group is None or group.size() != size or rank not in ranks:
            found = "none" if group is None else f"a group of {group.size()} ranks {ranks}"
            raise invalid_groups(
                f"parallel_state.{capabilities.dynamic_cp_group_getter}(group_size={size}) returned {found}: "
                f"dynamic context parallelism needs the DP x CP sub-groups of every power-of-two size up to {pool}; "
                f"initialise Megatron-Core with {_init_hint(capabilities, min_size)}"
            )
        size *= 2


def _group_ranks(group: Any) -> list[int]:
    if group is None:
        return []
    dist = importlib.import_module("torch.distributed")
    return list(dist.get_process_group_ranks(group))
