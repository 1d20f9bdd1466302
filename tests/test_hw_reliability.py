"""Issue 55: stop paths of ``robopolicy run``, stale commands after a frozen driver call,
far-out-of-range commands (the transport's items live in tests/test_hw_auth.py)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hardware.control import (ActionScheduler, ControlNode, NodeConfig, OutOfRangeCommand, SafetyFilter)
from test_hw_doubles import PointDriver, ScriptSource, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _hold(state, t):
    return np.repeat(np.asarray(state, float)[None], 20, axis=0)


def _node(driver, source, **cfg):
    node = ControlNode(driver, source, ActionScheduler("latest"), SafetyFilter(driver.spec, 1.0 / driver.spec.rate_hz),
                       NodeConfig(fifo=False, **cfg))
    node.start()
    return node


# -- item 8: a command far outside the range is a fault, not a clamp ------------------------------
def test_far_out_of_range_command_is_refused_not_clamped():
    drv = PointDriver()  # joints in [-2, 2]: span 4, a fault beyond 3 spans: [-14, 14]
    f = SafetyFilter(drv.spec, 0.002)
    f.reset(np.zeros(3))
    for bad in (1e6, -1.7e308, 1.7e308, 14.5):
        with pytest.raises(OutOfRangeCommand, match="j1"):
            f(np.array([0.0, bad, 0.0]))
    assert f.counts["out_of_range"] == 4
    out = f(np.array([0.0, 2.5, 0.0]))  # a little past the bound is still clamped, as before
    assert out[1] <= 2.0 and f.counts["position"] >= 1
    loose = SafetyFilter(drv.spec, 0.002, fault_spans=None)  # configurable, down to "never"
    loose.reset(np.zeros(3))
    assert loose(np.array([0.0, 1e6, 0.0]))[1] <= 2.0


def test_node_faults_on_a_far_out_of_range_chunk_and_never_moves_there():
    drv = PointDriver()
    calls = []

    def fn(state, t):
        calls.append(t)
        chunk = np.zeros((10, 3))
        if len(calls) > 3:
            chunk[:, 0] = 1e6
        return chunk

    node = _node(drv, ScriptSource(fn))
    try:
        assert wait_for(lambda: node.fault is not None)
        assert node.fault.code == "out_of_range" and drv.stops
        assert np.abs(drv.q).max() < 0.5  # the arm was not driven to its limit
    finally:
        node.close()


# -- item 4: a driver call that freezes while holding the GIL ------------------------------------
class FreezingDriver(PointDriver):
    """read() freezes once for ``freeze_s`` inside a C call that keeps the GIL (the watchdog
    thread cannot run); records the time of every write."""

    def __init__(self):
        super().__init__()
        self.freeze_s = 0.0
        self.write_times: list[float] = []
        self.freeze_end = None

    def read(self):
        if self.freeze_s:
            us, self.freeze_s = int(self.freeze_s * 1e6), 0.0
            ctypes.PyDLL(None).usleep(us)  # PyDLL: the GIL stays held
            self.freeze_end = time.monotonic()
        return super().read()

    def write(self, command):
        self.write_times.append(time.monotonic())
        return super().write(command)


@pytest.mark.parametrize("freeze_s,timeout", [(1.0, 0.5), (0.3, 0.1)])
def test_no_stale_command_is_written_after_a_gil_holding_freeze(freeze_s, timeout):
    drv = FreezingDriver()
    node = _node(drv, ScriptSource(_hold), command_timeout=timeout)
    try:
        assert wait_for(lambda: drv.writes > 50)
        assert node.fault is None
        drv.freeze_s = freeze_s
        assert wait_for(lambda: node.fault is not None, timeout=5)
        assert node.fault.code == "command_timeout", node.fault
        # not a single command written after the freeze: it would be freeze_s old
        assert not [t for t in drv.write_times if t >= drv.freeze_end], "a stale command was written"
        assert drv.stops and drv.stops[0] >= drv.freeze_end
        assert drv.stops[0] - drv.freeze_end < 0.05  # stopped in the tick the call returned in
        rep = node.report()
        assert rep["slow_driver_calls"]["count"] >= 1 and rep["slow_driver_calls"]["longest_ms"] >= freeze_s * 900
    finally:
        node.close()


# -- item 3: every stop path runs the safe stop, the disconnect and the report --------------------
class RecordingDriver(PointDriver):
    def __init__(self):
        super().__init__(dim=3, rate_hz=100.0)
        self.disconnected = False
        self.connected = False

    def connect(self):
        self.connected = True

    def disconnect(self):
        self.disconnected = True
        super().disconnect()


@pytest.fixture
def run_with_doubles(monkeypatch, tmp_path):
    from robopolicy.deploy import run as run_mod

    made = {}

    def build_node(cfg, workdir=None):
        drv = RecordingDriver()
        node = ControlNode(drv, ScriptSource(_hold), ActionScheduler("latest"), SafetyFilter(drv.spec, 0.01),
                           NodeConfig(fifo=False))
        made.update(driver=drv, node=node)
        return drv, node

    monkeypatch.setattr(run_mod, "build_node", build_node)
    cfg = run_mod.RunConfig(duration=20.0, report=str(tmp_path / "report.json"), status=False)
    return run_mod, cfg, made


def _later(seconds, fn):
    t = threading.Timer(seconds, fn)
    t.start()
    return t


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_each_stop_signal_stops_disconnects_and_reports(run_with_doubles, sig, code):
    run_mod, cfg, made = run_with_doubles
    _later(0.5, lambda: os.kill(os.getpid(), sig))
    t0 = time.monotonic()
    report = run_mod.run(cfg)
    assert time.monotonic() - t0 < 5.0
    drv, node = made["driver"], made["node"]
    assert drv.stops and drv.disconnected
    sd = report["shutdown"]
    assert sd["signal"] == sig.name and sd["driver_stopped"] and sd["driver_disconnected"]
    assert report["exit_code"] == code == run_mod.exit_code(json.loads(Path(cfg.report).read_text()))
    assert sd["signal_to_stop_s"] < 0.5  # measured; well within a period on an idle machine
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or signal.getsignal(signal.SIGTERM) != node


def test_a_second_signal_does_not_cut_the_shutdown_short(run_with_doubles, monkeypatch):
    run_mod, cfg, made = run_with_doubles
    real_close = ControlNode.close

    def slow_close(self, timeout=2.0):
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while the shutdown runs
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # and systemd's SIGTERM
        time.sleep(0.05)
        real_close(self, timeout)

    monkeypatch.setattr(ControlNode, "close", slow_close)
    _later(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    report = run_mod.run(cfg)
    assert made["driver"].stops and made["driver"].disconnected
    assert report["shutdown"]["signals"] == ["SIGINT", "SIGINT", "SIGTERM"]
    assert report["exit_code"] == 130 and Path(cfg.report).is_file()


def test_an_exception_stops_disconnects_reports_and_is_raised(run_with_doubles, monkeypatch):
    run_mod, cfg, made = run_with_doubles
    cfg.status = True
    calls = []

    def broken_status(s):
        calls.append(1)
        raise RuntimeError("status line broke")

    monkeypatch.setattr(run_mod, "format_status", broken_status)
    with pytest.raises(RuntimeError, match="status line broke"):
        run_mod.run(cfg)
    assert made["driver"].stops and made["driver"].disconnected
    report = json.loads(Path(cfg.report).read_text())
    assert report["shutdown"]["cause"] == "exception" and "status line broke" in report["shutdown"]["error"]


def test_a_latched_fault_gives_a_non_zero_exit(run_with_doubles):
    run_mod, cfg, made = run_with_doubles
    cfg.duration = 1.0
    _later(0.3, lambda: made["node"].estop("test"))
    report = run_mod.run(cfg)
    assert report["active_fault"]["code"] == "estop" and report["exit_code"] == run_mod.FAULT_EXIT != 0


def test_sigterm_to_robopolicy_run_stops_the_sim_arm_and_exits_143(tmp_path):
    report = tmp_path / "timing.json"
    cmd = [sys.executable, "-m", "robopolicy.cli", "run", "--robot", str(ROOT / "configs/robots/sim_arm.yaml"),
           "--policy", "hold", "--report", str(report), "robot.driver.kwargs.cameras=false", "robot.loop.fifo=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")})
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[run]") and " 0 ticks" not in line:
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, "".join(lines) + out
    rep = json.loads(report.read_text())
    sd = rep["shutdown"]
    assert sd["signal"] == "SIGTERM" and sd["driver_stopped"] and sd["driver_disconnected"], sd
    assert "stopped by SIGTERM" in out


# -- node hooks the daemon stands on: swapping the source, and silence after a fault reset ---------
class _SilenceWatchingSource(ScriptSource):
    """A ScriptSource that, like the policy worker's, faults after ``silence`` s without a reply."""

    def __init__(self, fn, silence=0.3):
        super().__init__(fn)
        self.silence, self.last_reply, self.restarts = silence, float("nan"), 0

    def poll(self, now):
        out = super().poll(now)
        if out:
            self.last_reply = now
        return out

    def health(self, now):
        if now - self.last_reply > self.silence:
            return f"silent for {now - self.last_reply:.2f}s"
        return None

    def restart_silence_clock(self):
        self.restarts += 1
        self.last_reply = float("nan")


def test_a_fault_reset_restarts_the_sources_silence_clock():
    drv = PointDriver()
    src = _SilenceWatchingSource(_hold)
    node = _node(drv, src)
    try:
        assert wait_for(lambda: src.last_reply == src.last_reply)  # a first reply came
        node.estop("test")
        assert wait_for(lambda: node.fault is not None)
        time.sleep(src.silence * 2)  # latched: nothing is sent, nothing answers
        assert node.reset() and src.restarts == 1
        time.sleep(src.silence)
        assert node.fault is None  # no source_silent fault right after the reset
    finally:
        node.close()


def test_swap_source_hands_over_between_ticks_and_returns_the_old_one():
    drv = PointDriver()
    first, second = ScriptSource(_hold), ScriptSource(_hold)
    node = _node(drv, first)
    try:
        assert wait_for(lambda: first.submitted > 0)
        ticks = node.timer.n
        old = node.swap_source(second)
        assert old is first and node.source is second and node.timer.n >= ticks + 2
        n_first = first.submitted
        assert wait_for(lambda: second.submitted > 0)
        time.sleep(0.1)
        assert first.submitted == n_first and node.fault is None
    finally:
        node.close()
