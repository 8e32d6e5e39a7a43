"""What a real packing step does on each generation, observed on real Megatron-LM trees.

``tests/test_history.py`` runs each request for real on 4 gloo ranks on the first commit of every
generation and asserts these outcomes; the fake-MCore suite (``tests/test_facade_fakes.py``) takes its
expected probe answers from here, so the fakes are held to what real trees do, not to the code under test.
"""

from __future__ import annotations

STATIC = ("dp_balanced", False)
DYNAMIC = ("default_dynamic_cp", True)

_PORTABLE = {STATIC: True, DYNAMIC: True}
"""Dynamic CP on the portable backend needs DP x CP sub-groups (0.16 on) and runs with the model support applied."""
_DEV_STATIC_ONLY = {STATIC: True, DYNAMIC: False}
_DEV_BOTH = {STATIC: True, DYNAMIC: True}

RUNS: dict[str, dict[tuple[str, bool], bool]] = {
    "G0": {STATIC: True, DYNAMIC: False},
    "G1": _PORTABLE,
    "M1": _PORTABLE,
    "M2": _PORTABLE,
    "M3": _PORTABLE,
    "G2": _DEV_STATIC_ONLY,
    "G3": _DEV_STATIC_ONLY,
    **{gen: _DEV_BOTH for gen in ("G4", "G4b", "G5", "G6", "G6b", "G7", "G8")},
}
"""Per generation: does ``(scheduler, dynamic_cp)`` run end to end through the facade (every check passing,
``packing.enable_dynamic_cp_model_support()`` applied as a trainer would)?"""
