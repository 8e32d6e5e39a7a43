"""A probe refusal fails the test where the session's pin claims the case, and skips it elsewhere."""

from __future__ import annotations

import pytest

from tests.claims import EXPECT_PIN, claimed_by, refused


@pytest.mark.parametrize(
    ("pin", "scheduler", "dynamic_cp", "claimed"),
    [
        ("core_r0.16", "default_dynamic_cp", True, True),
        ("core_r0.16", "dp_balanced", False, True),
        ("core_r0.13", "default_dynamic_cp", True, False),
        ("dev", "default_dynamic_cp", False, False),
        (None, "dp_balanced", False, False),
    ],
)
def test_a_refused_case_fails_only_where_the_pin_claims_it(
    pin: str | None, scheduler: str, dynamic_cp: bool, claimed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if pin is None:
        monkeypatch.delenv(EXPECT_PIN, raising=False)
    else:
        monkeypatch.setenv(EXPECT_PIN, pin)
    assert claimed_by(scheduler, dynamic_cp) == (pin if claimed else None)
    outcome = pytest.fail.Exception if claimed else pytest.skip.Exception
    with pytest.raises(outcome) as raised:
        refused(scheduler, dynamic_cp, "the probe's sentence")
    assert "the probe's sentence" in str(raised.value)
    if claimed:
        assert f"pin {pin!r} claims {scheduler}:" in str(raised.value)
