"""The idle-share arithmetic of glm5_jax/engine/timing.py on hand-made call records: device work is
serial, a call dispatched behind a running one starts when that one ends, and a gap between one
call's end and the next call's dispatch is idle time."""

import pytest

from glm5_jax.engine.timing import CallRecord, StepTiming, summarize


def record(dispatched, ready, host=0.001, steps=8, rows=4):
    return CallRecord("decode", rows, steps, {"plan": host / 2, "deliver": host / 2, "fetch": 0.5},
                      dispatched, ready)


def test_overlapped_calls_leave_no_idle_time_and_gaps_count():
    # Call 2 is dispatched while call 1 runs (starts at 1.0); call 3 only after a gap of 0.5.
    records = [record(0.0, 1.0), record(0.5, 2.0), record(2.5, 3.5)]
    summary = summarize(records)
    assert summary["window_s"] == pytest.approx(3.5)
    assert summary["idle_share"] == pytest.approx(0.5 / 3.5)
    assert summary["device_ms_per_call"] == pytest.approx(1e3 * 3.0 / 3)
    assert summary["host_ms_per_call"] == pytest.approx(1.0)  # fetch is waiting, not host work
    assert summary["host_ms_per_step"] == pytest.approx(1.0 / 8)
    assert summarize(records[:2])["idle_share"] == pytest.approx(0.0)
    assert summarize([record(0.0, None)]) == {}  # not ready yet: nothing to say


def test_disabled_timing_records_nothing():
    timing = StepTiming(False)
    with timing.host("plan"):
        pass
    timing.dispatched("decode", 1, 8, None)
    timing.ran("mixed", 1, 1, 0.0)
    assert timing.snapshot() == []
