"""StepTiming.host (glm5_jax/engine/timing.py): disabled, one shared no-op context; enabled, each
phase adds its wall time and the engine thread's CPU time to the next call's record."""

import time

from glm5_jax.engine.timing import StepTiming, summarize


def test_disabled_host_phases_share_one_no_op_context():
    timing = StepTiming(False)
    assert timing.host("plan") is timing.host("deliver")
    with timing.host("plan"), timing.host("arrays"):
        pass
    assert timing._phases == {}


def test_host_phases_record_wall_and_cpu_time():
    timing = StepTiming(True)
    with timing.host("deliver"):
        time.sleep(0.02)  # waiting: wall time, next to no CPU time
    with timing.host("plan"):
        sum(range(200_000))  # working: CPU time
    timing.ran("mixed", 1, 1, time.perf_counter())
    (record,) = timing.snapshot()
    assert record.phases["deliver"] >= 0.02 > record.phases["deliver/cpu"]
    assert 0 < record.phases["plan/cpu"] <= record.phases["plan"] + 1e-3
    assert record.host_cpu_seconds == record.phases["plan/cpu"] + record.phases["deliver/cpu"]
    summary = summarize([record])
    assert summary["host_cpu_ms_per_call"] < summary["host_ms_per_call"]
    assert summary["deliver_cpu_ms_per_call"] < summary["deliver_ms_per_call"]
