"""A request's timeline (tidal/observe/timeline.py): its hops are contiguous and add up to its duration,
whichever stamps it reached; and the engine stamps its way to the first token once, in order."""

from __future__ import annotations

import pytest

from tidal.observe.timeline import HOP_NAMES, HOPS, Timeline
from tidal.wire import EngineTiming


def reached_all() -> Timeline:
    t = Timeline(10.0)
    t.parsed, t.tokenized, t.admitted, t.queued = 10.001, 10.003, 10.0031, 10.0032
    t.first_output(EngineTiming(10.005, 10.010, [10.010, 10.020], 10.030), 10.031, 10.032, 10.033)
    t.wrote(10.035)
    t.wrote(10.045)
    t.ended = 10.045
    return t


def test_a_streamed_request_has_every_hop_in_order_and_they_sum_to_its_duration():
    t = reached_all()
    hops = t.hops()
    assert [h for h, _, _ in hops] == [h for h, _ in HOPS] + ["stream"]
    assert all(start <= end for _, start, end in hops)
    assert all(hops[i][2] == hops[i + 1][1] for i in range(len(hops) - 1)), "contiguous"
    assert sum(end - start for _, start, end in hops) == pytest.approx(t.ended - t.received)
    assert dict((h, e - s) for h, s, e in hops)["prefill"] == pytest.approx(0.020)
    assert t.first_written - t.received == pytest.approx(0.035)  # the client-true time to first token
    assert t.num_frames == 2


def test_a_request_that_ended_early_runs_its_last_stamp_to_the_end():
    t = Timeline(5.0)
    t.parsed, t.tokenized, t.admitted, t.queued = 5.1, 5.2, 5.3, 5.4
    t.ended = 6.0  # aborted while queued: the engine never reported it
    hops = t.hops()
    assert [h for h, _, _ in hops] == ["parse", "tokenize", "admit", "enqueue", "end"]
    assert sum(end - start for _, start, end in hops) == pytest.approx(1.0)


def test_a_fork_shares_the_front_stamps_only():
    t = reached_all()
    other = t.fork()
    assert (other.received, other.parsed, other.tokenized) == (t.received, t.parsed, t.tokenized)
    assert other.admitted == 0.0 and other.engine is None and other.num_frames == 0


def test_every_hop_has_a_metric_label():
    assert set(HOP_NAMES) == {h for h, _ in HOPS} | {"stream", "end"}
