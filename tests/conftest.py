"""Shared fixtures: every fake Megatron-Core generation, installed one at a time."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.fake_mcore import FakeMCore, g0, g1, g2, g4, g5, g7, installed, m1, m3

FAMILIES: tuple[ModuleType, ...] = (g0, g1, g2, g4, g5, g7, m1, m3)
FAKE_GENERATIONS: list[tuple[ModuleType, str]] = [(family, gen) for family in FAMILIES for gen in family.GENERATIONS]


@pytest.fixture(params=FAKE_GENERATIONS, ids=[gen for _, gen in FAKE_GENERATIONS])
def fake_mcore(request: pytest.FixtureRequest) -> Iterator[FakeMCore]:
    """Each fake generation in turn, installed in ``sys.modules`` with mcore_compat's caches reset."""
    family, generation = request.param
    with installed(family.build(generation)) as fake:
        yield fake
