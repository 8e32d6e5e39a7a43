"""A claimed case never skips: where the session's pin (``$MCORE_COMPAT_EXPECT_PIN``, set by every ``nox`` pin
session) says in ``pins.toml`` that a scheduler runs in a CP mode, a probe refusal of that case fails the test with
the probe's sentence; elsewhere (no pin named, or a case the pin does not claim) it skips, saying why."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

from mcore_compat import pins

__all__ = ["EXPECT_PIN", "claimed_by", "refused"]

EXPECT_PIN = "MCORE_COMPAT_EXPECT_PIN"


def claimed_by(scheduler: str, dynamic_cp: bool) -> str | None:
    """The session's pin where its ``runs`` claim ``scheduler`` with static or dynamic CP, else None."""
    name = os.environ.get(EXPECT_PIN)
    pin = pins.load().pins.get(name) if name else None
    mode = "dynamic" if dynamic_cp else "static"
    return pin.name if pin is not None and f"{scheduler}:{mode}" in pin.runs else None


def refused(scheduler: str, dynamic_cp: bool, reason: str) -> NoReturn:
    """Fail where the session's pin claims the refused case, else skip with ``reason``."""
    pin = claimed_by(scheduler, dynamic_cp)
    if pin is not None:
        mode = "dynamic" if dynamic_cp else "static"
        pytest.fail(f"pin {pin!r} claims {scheduler}:{mode} (pins.toml runs), yet it was refused: {reason}")
    pytest.skip(reason)
