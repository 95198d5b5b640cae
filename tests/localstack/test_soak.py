"""The soak's own run, short: every kind of request it mixes goes through a real stack,
with no error, the greedy and seeded requests repeat their tokens (whatever γ a greedy one
ran with), and no session handle or cache is left once the clients stop."""
from __future__ import annotations

import asyncio

import pytest

from localstack.soak import KINDS, format_report, passed, soak

pytestmark = pytest.mark.e2e


def test_a_short_soak_through_every_kind_of_request_leaves_nothing_behind(local_stack):
    report = asyncio.run(soak(local_stack, streams=4, seconds=300, max_new_tokens=16, max_requests=3 * len(KINDS)))
    assert passed(report), format_report(report)
    assert report["kinds"] == {kind: 3 for kind in KINDS}
    assert report["cancelled"] >= 1
    # each prompt's greedy requests (adaptive γ, γ = 4, target-only) share one key
    assert report["ok"] - report["checked"] >= 3
