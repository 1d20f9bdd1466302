"""ActionScheduler, WaypointFollower, SafetyFilter and the ControlNode's faults (in-process)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest

from hardware.control import ActionScheduler, Chunk, ControlNode, NodeConfig, NonFiniteCommand, SafetyFilter, WaypointFollower
from hardware.drivers.base import DriverSpec
from test_hw_doubles import PointDriver, ScriptSource, wait_for

BOUND = 0.1  # generous bound on "within one control period" for a shared CI machine (s)


# -- scheduler ----------------------------------------------------------------------------------
def test_late_steps_are_dropped_and_steps_interpolated():
    s = ActionScheduler("latest")
    values = np.arange(10, dtype=float)[:, None]  # step i = value i, 20 Hz
    late = s.add(Chunk(values, t_obs=100.0, dt=0.05), now=100.12)  # arrived 120 ms after the observation
    assert late == 2 and s.dropped_steps == 2
    assert s.command_at(100.125)[0] == pytest.approx(2.5)  # between steps 2 and 3, at control rate
    assert s.command_at(100.45)[0] == pytest.approx(9.0)
    assert s.command_at(100.46) is None  # past the chunk: nothing due
    assert s.add(Chunk(values, 100.0, 0.05), now=101.0) == 10 and s.dropped_chunks == 1


def test_temporal_ensembling_weights_older_chunks_more():
    s = ActionScheduler("ensemble", ensemble_k=1.0)
    s.add(Chunk(np.zeros((10, 1)), 0.0, 0.1), now=0.0)
    s.add(Chunk(np.ones((10, 1)), 0.0, 0.1), now=0.01)
    w0, w1 = 1.0, math.exp(-1.0)
    assert s.command_at(0.5)[0] == pytest.approx(w1 / (w0 + w1))


def test_rtc_crossfade_hands_over_from_the_old_plan_to_the_new():
    s = ActionScheduler("rtc", crossfade=0.1)
    s.add(Chunk(np.zeros((20, 1)), 0.0, 0.05), now=0.0)
    s.add(Chunk(np.ones((20, 1)), 0.2, 0.05), now=0.3)
    assert s.command_at(0.3)[0] == pytest.approx(0.0)
    assert s.command_at(0.35)[0] == pytest.approx(0.5)
    assert s.command_at(0.45)[0] == pytest.approx(1.0)


def _reference_command(chunks, blend, k, crossfade, hold_last, t):
    """Blend written the direct way: interpolate every covering chunk, then weight."""
    def interp(v, t0, dt):
        x = (t - t0) / dt
        if x <= 0:
            return v[0]
        i = int(x)
        return v[-1] if i >= len(v) - 1 else v[i] * (1 - (x - i)) + v[i + 1] * (x - i)

    act = [c for c in chunks if c[1] - 1e-9 <= t <= c[1] + (len(c[0]) - 1) * c[2] + hold_last + 1e-9]
    if not act:
        return None
    if blend == "latest" or len(act) == 1:
        return interp(*act[-1][:3])
    if blend == "ensemble":
        w = [math.exp(-k * i) for i in range(len(act))]
        return sum(wi * interp(*c[:3]) for wi, c in zip(w, act)) / sum(w)
    out = interp(*act[0][:3])
    for c in act[1:]:
        a = min(1.0, max(0.0, (t - c[3]) / crossfade))
        out = (1 - a) * out + a * interp(*c[:3])
    return out


@pytest.mark.parametrize("blend", ["ensemble", "rtc", "latest"])
def test_scheduler_blend_matches_the_direct_computation(blend):
    """Ring-buffer gather + one dot product == interpolating each chunk and weighting, over a
    stream of chunks of varying length (buffer growth), late arrivals and expiry."""
    rng = np.random.default_rng(0)
    s = ActionScheduler(blend, ensemble_k=0.3, crossfade=0.07, max_chunks=4, hold_last=0.02)
    kept = []  # (values after dropping late steps, t0, dt, t_arrived) in arrival order
    now = 10.0
    for n in range(40):
        h = int(rng.integers(1, 30))
        values, t_obs, dt = rng.normal(size=(h, 3)), now - rng.uniform(0, 0.08), float(rng.choice([0.02, 0.05]))
        late = s.add(Chunk(values, t_obs, dt), now)
        if late < h:
            kept = (kept + [(values[late:], t_obs + late * dt, dt, now)])[-4:]
        for t in now + np.sort(rng.uniform(0, 0.06, 5)):
            ref = _reference_command(kept, blend, 0.3, 0.07, 0.02, t)
            got = s.command_at(t)
            assert (got is None) == (ref is None), (n, t)
            if got is not None:
                np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
        now += rng.uniform(0.01, 0.08)
    with pytest.raises(ValueError, match="action size"):
        s.add(Chunk(np.zeros((5, 4)), now, 0.05), now)  # another action size while chunks fly


@pytest.mark.parametrize("accel", [True, False])
def test_safety_fast_path_equals_the_staged_clamps(accel):
    """The one-check fast path (no limit binds) gives the staged filter's commands and counts."""
    spec = DriverSpec("arm", tuple("abcd"), -np.ones(4), np.ones(4), max_rate=np.array([1.0, 2.0, 3.0, 4.0]),
                      max_rate2=200.0 if accel else None, rate_hz=100.0, command_timeout=0.5)
    fast, staged = SafetyFilter(spec, 0.01, max_step=0.025), SafetyFilter(spec, 0.01, max_step=0.025)
    staged._fast = False
    rng = np.random.default_rng(1)
    for f in (fast, staged):
        f.reset(np.zeros(4))
    target = np.zeros(4)
    for _ in range(3000):
        target = np.clip(target + rng.normal(0, 0.01, 4), -1.1, 1.1)  # sometimes beyond the bounds or too fast
        a, b = fast(target), staged(target)
        np.testing.assert_allclose(a, b, atol=1e-12)
    assert fast.counts == staged.counts and sum(fast.counts.values()) > 0


def test_waypoint_follower_compensates_for_motion_since_the_observation():
    f = WaypointFollower(v_max=1.0, omega_max=1.0, lookahead=0.3)
    f.integrate(np.zeros(2), 0.0)
    wp = np.array([[0.1 * (i + 1), 0.0, 0.0] for i in range(8)])  # straight ahead at 1 m/s, dt 0.1
    f.add(Chunk(wp, 0.0, 0.1, kind="waypoints"), now=0.0)
    v, w = f.command_at(0.0)
    assert v == pytest.approx(1.0, rel=0.05) and abs(w) < 1e-6
    # the robot turned left by 0.3 rad since: the same plan now needs a right turn
    f.pose = np.array([0.0, 0.0, 0.3])
    v, w = f.command_at(0.05)
    assert w < -0.1


# -- safety -------------------------------------------------------------------------------------
def _spec():
    return DriverSpec("arm", ("a", "b"), [-1, -1], [1, 1], max_rate=10.0, max_rate2=100.0, rate_hz=100)


def test_safety_clamps_are_counted_and_non_finite_is_refused():
    f = SafetyFilter(_spec(), dt=0.01)
    f.reset(np.zeros(2))
    out = f(np.array([5.0, 0.0]))  # beyond the position bound and the velocity limit
    assert out[0] == pytest.approx(0.01) and out[1] == 0.0  # acceleration: 100 * 0.01^2 per tick
    assert f.counts["position"] == 1 and f.counts["velocity"] == 1 and f.counts["acceleration"] == 1
    with pytest.raises(NonFiniteCommand):
        f(np.array([np.nan, 0.0]))
    assert f.counts["non_finite"] == 1


def test_safety_workspace_box_keeps_the_last_safe_command():
    f = SafetyFilter(_spec(), dt=0.01, workspace_low=np.array([-0.5]), workspace_high=np.array([0.05]),
                     workspace_point=lambda q: q[:1])
    f.reset(np.zeros(2))
    for _ in range(20):
        out = f(np.array([1.0, 0.0]))
    assert out[0] <= 0.05 and f.counts["workspace"] > 0


# -- node ---------------------------------------------------------------------------------------
def _node(driver, source, **cfg):
    sched = ActionScheduler("latest")
    safety = SafetyFilter(driver.spec, 1.0 / driver.spec.rate_hz)
    node = ControlNode(driver, source, sched, safety, NodeConfig(**cfg))
    node.start()
    return node


def _moving(state, t):
    return np.array([[0.3 * math.sin(t + 0.05 * i)] * 3 for i in range(20)])


@pytest.fixture
def moving_node():
    drv = PointDriver()
    src = ScriptSource(_moving)
    node = _node(drv, src)
    assert wait_for(lambda: drv.writes > 50)
    yield node, drv, src
    node.close()


def test_estop_during_motion_stops_within_a_period_and_latches(moving_node):
    node, drv, _ = moving_node
    t = time.monotonic()
    node.estop("test")
    assert wait_for(lambda: drv.stops)
    latency = drv.stops[0] - t
    assert latency < BOUND, latency
    assert node.fault.code == "estop" and node.fault.stop_latency < BOUND
    writes = drv.writes
    time.sleep(0.05)
    assert drv.writes == writes  # latched: no policy command reaches the driver
    assert node._thread.is_alive() and node.status()["fault"].startswith("estop")
    assert node.reset()
    assert wait_for(lambda: drv.writes > writes + 10)  # explicit reset resumes


def test_driver_exception_faults_and_node_stays_up(moving_node):
    node, drv, _ = moving_node
    drv.fail_read = True
    assert wait_for(lambda: node.fault is not None)
    assert node.fault.code == "driver_error" and "bus timeout" in node.fault.reason
    assert drv.stops and node.fault.stop_latency < BOUND
    ticks = node.timer.n
    assert wait_for(lambda: node.timer.n > ticks + 10)  # still ticking
    assert node.driver_errors > 1


def test_driver_hang_is_caught_by_the_watchdog(moving_node):
    node, drv, _ = moving_node
    t = time.monotonic()
    drv.hang.set()
    assert wait_for(lambda: node.fault is not None)
    assert node.fault.code == "driver_hang"
    assert drv.stops and drv.stops[0] - t < node.cfg.driver_timeout + BOUND
    assert node.fault.stop_latency < BOUND  # from the hang being declared to the stop command
    assert node.status()["fault"].startswith("driver_hang")
    drv.release.set()
    drv.hang.clear()


def test_a_process_stall_is_counted_not_a_driver_hang(moving_node):
    """Another thread holding the GIL for 3x the driver timeout (as an OS preemption of the whole
    process would) stops the loop and the watchdog alike: a stall, not a hang of the driver."""
    import ctypes

    node, drv, _ = moving_node
    drv.read_delay = 0.75 * node.period  # most of each tick is spent inside the driver
    time.sleep(0.05)
    skipped = node.timer.skipped
    hold_gil_us = int(node.cfg.driver_timeout * 3e6)
    t = threading.Thread(target=lambda: ctypes.PyDLL(None).usleep(hold_gil_us))  # PyDLL keeps the GIL
    t.start()
    t.join()
    writes = drv.writes
    assert wait_for(lambda: drv.writes > writes + 20)
    assert node.fault is None, node.fault
    assert node.stalls >= 1 and node.report()["stalls"]["longest_ms"] > node.cfg.driver_timeout * 1e3
    assert node.timer.skipped > skipped  # the deadlines it could not run are counted


def test_classify_miss_names_the_cause():
    from types import SimpleNamespace as U

    from hardware.control.clock import classify_miss

    def u(iv=0, v=0, mn=0, mj=0):
        return U(ru_nivcsw=iv, ru_nvcsw=v, ru_minflt=mn, ru_majflt=mj)

    assert classify_miss(3e-3, 1e-4, 1e-4, u(), u())["cause"] == "late_wakeup"
    assert classify_miss(1e-5, 3e-3, 1e-3, u(), u(iv=1))["cause"] == "preempted"
    assert classify_miss(1e-5, 3e-3, 3e-3, u(), u(mj=1))["cause"] == "page_fault"
    assert classify_miss(1e-5, 3e-3, 4e-4, u(), u(v=1))["cause"] == "off_cpu_wait"
    d = classify_miss(1e-5, 3e-3, 2.9e-3, u(), u())
    assert d["cause"] == "on_cpu" and d["involuntary_switches"] == 0 and d["work_us"] == pytest.approx(3000)
    assert classify_miss(1e-5, 3e-3, float("nan"), None, None)["cause"] == "unknown"


def test_missed_ticks_are_classified_by_what_the_thread_did(moving_node):
    """A tick that blocks in the driver is an off-CPU wait; one that computes is on-CPU."""
    from hardware.control.clock import thread_usage

    if thread_usage() is None:
        pytest.skip("no per-thread resource usage on this OS")
    node, drv, _ = moving_node
    read, todo = drv.read, {"n": 0, "how": "sleep"}

    def slow_read():
        if todo["n"] > 0:
            todo["n"] -= 1
            if todo["how"] == "sleep":  # blocked on I/O: off the CPU
                time.sleep(1.5 * node.period)
            else:  # computing: on the CPU
                end = time.monotonic() + 1.5 * node.period
                while time.monotonic() < end:
                    pass
        return read()

    drv.read = slow_read
    for how in ("sleep", "spin"):
        before = dict(node.timer.miss_causes)
        todo.update(n=5, how=how)
        assert wait_for(lambda: todo["n"] == 0)
        time.sleep(0.05)
        got = {k: v - before[k] for k, v in node.timer.miss_causes.items()}
        if how == "sleep":
            assert got["off_cpu_wait"] >= 3, got
        else:
            assert got["on_cpu"] + got["preempted"] >= 3 and got["on_cpu"] >= 1 and got["off_cpu_wait"] <= 2, got
    assert node.report()["timing"]["miss_causes"]["off_cpu_wait"] >= 3
    assert node.timer.miss_details[-1]["work_us"] > 1000


def test_nan_chunk_is_a_fault_not_a_command():
    drv = PointDriver()
    calls = []

    def fn(state, t):
        calls.append(t)
        chunk = np.zeros((10, 3))
        if len(calls) > 3:
            chunk[:, 1] = np.nan
        return chunk

    node = _node(drv, ScriptSource(fn))
    try:
        assert wait_for(lambda: node.fault is not None)
        assert node.fault.code == "non_finite"
        assert np.all(np.isfinite(drv.q)) and drv.stops
        assert node.safety.counts["non_finite"] == 1
    finally:
        node.close()


def test_command_timeout_faults_when_the_source_goes_quiet():
    drv = PointDriver()
    src = ScriptSource(_moving)
    node = _node(drv, src, command_timeout=0.1)
    try:
        assert wait_for(lambda: drv.writes > 20)
        src.fn = None
        src.submit = lambda obs, t: None  # the policy stops answering
        assert wait_for(lambda: node.fault is not None)
        assert node.fault.code == "command_timeout" and drv.stops
    finally:
        node.close()


def test_a_first_chunk_late_in_full_waits_for_the_next_instead_of_timing_out():
    """A cold worker's first chunk can arrive after all its steps are due: no command yet, so the
    startup allowance (not the command timeout) still applies and the next chunk takes over."""
    drv = PointDriver()
    src = ScriptSource(_moving)
    real_submit, calls = src.submit, []

    def submit(obs, t_obs):
        calls.append(t_obs)
        real_submit(obs, t_obs - 5.0 if len(calls) == 1 else t_obs)  # the first one: 5 s stale
    src.submit = submit
    node = _node(drv, src, command_timeout=0.1)
    try:
        assert wait_for(lambda: drv.writes > 20 and len(calls) > 3)
        assert node.fault is None
        assert node.scheduler.dropped_chunks >= 1
    finally:
        node.close()


def test_timing_is_recorded_with_real_timestamps(moving_node):
    node, drv, _ = moving_node
    time.sleep(0.2)
    rep = node.report()
    t = rep["timing"]
    assert t["ticks"] > 50 and t["lateness_us"]["p50"] >= 0
    assert rep["scheduler"]["chunks_received"] > 0
    # ticks ≈ elapsed / period: the timer does not pretend the loop kept a rate it did not keep
    assert t["ticks"] + t["skipped_ticks"] <= (time.monotonic() - node._t_start + 0.5) * node.rate
    # each tick's start is kept (time.monotonic), increasing, about one period apart on average
    n = node.timer.n
    starts = node.timer.start[:n]
    assert np.all(np.isfinite(starts)) and np.all(np.diff(starts) > 0)
    assert starts[-1] <= time.monotonic()
    assert np.median(np.diff(starts)) == pytest.approx(1.0 / node.rate, rel=0.5)
