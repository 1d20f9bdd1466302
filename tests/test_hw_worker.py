"""Node → policy worker process → node: the real pipeline, and what happens when the worker fails."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest

from hardware.control import ActionScheduler, ControlNode, NodeConfig, PolicyWorkerSource, SafetyFilter
from test_hw_doubles import PointDriver, wait_for
from robopolicy.deploy.worker import load_policy

BOUND = 0.1


def _start(tmp_path, policy: str, driver=None):
    ep = f"ipc://{tmp_path}/policy.sock"
    cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", ep, "--policy", policy,
           "--parent-pid", str(os.getpid())]
    drv = driver or PointDriver(dim=6)
    src = PolicyWorkerSource(ep, cmd, request_hz=20)
    # These tests are about the worker; the driver-hang watchdog has its own (tests/test_hw_control.py)
    # and is given slack here for a cold worker start (torch import) on a busy 2-core machine.
    node = ControlNode(drv, src, ActionScheduler("ensemble"), SafetyFilter(drv.spec, 1 / drv.spec.rate_hz),
                       NodeConfig(driver_timeout=0.25))
    node.start()
    return node, drv, src


def test_scripted_policies_and_bad_checkpoints(tmp_path):
    obs = {"observation.state": np.zeros(6)}
    assert load_policy("hold").predict(obs, 0.0).shape == (20, 6)
    sine = load_policy("sine:amp=0.5,horizon=10")
    chunk = sine.predict(obs, 0.0)
    assert chunk.shape == (10, 6) and np.abs(chunk).max() > 0.1 and np.allclose(chunk[0], 0)
    assert load_policy("arc:v=0.5").predict(obs, 0.0).shape == (8, 3)
    np.savez(tmp_path / "r.npz", action=np.arange(12.0).reshape(6, 2), dt=0.1)
    rp = load_policy(f"replay:{tmp_path / 'r.npz'},horizon=3")
    np.testing.assert_array_equal(rp.predict(obs, 5.0), [[0, 1], [2, 3], [4, 5]])
    np.testing.assert_array_equal(rp.predict(obs, 5.2)[0], [4, 5])
    with pytest.raises(ValueError, match="config.yaml|checkpoint"):
        load_policy(str(tmp_path))  # a directory that is no checkpoint (trained ones: tests/test_refine.py)
    with pytest.raises(ValueError):
        load_policy("oracle")


def test_worker_drives_the_node_and_sigkill_is_a_latched_fault(tmp_path):
    node, drv, src = _start(tmp_path, "sine:amp=0.3")
    try:
        # generous: a cold worker start on a busy 2-core machine; the state is printed on failure
        assert wait_for(lambda: src.replies >= 5, timeout=60), (node.fault, src.stats(), src.proc.poll())
        assert wait_for(lambda: np.abs(drv.q).max() > 0.01)  # the sine moves the joints
        assert node.fault is None
        t_kill = time.monotonic()
        os.kill(src.proc.pid, signal.SIGKILL)
        assert wait_for(lambda: node.fault is not None)
        assert node.fault.code == "worker_died" and "SIGKILL" in node.fault.reason
        assert drv.stops and drv.stops[0] - t_kill < BOUND, drv.stops[0] - t_kill
        ticks = node.timer.n
        assert wait_for(lambda: node.timer.n > ticks + 10)  # the node stays up
        assert node.report()["active_fault"]["code"] == "worker_died"
    finally:
        node.close()


def test_nan_chunk_from_the_worker_is_a_fault(tmp_path):
    actions = np.zeros((200, 6), np.float32)
    actions[30:] = np.nan  # the policy goes bad after 1.5 s of replay
    np.savez(tmp_path / "nan.npz", action=actions, dt=0.05)
    node, drv, src = _start(tmp_path, f"replay:{tmp_path / 'nan.npz'}")
    try:
        assert wait_for(lambda: node.fault is not None, timeout=20)
        assert node.fault.code == "non_finite" and drv.stops
        assert np.all(np.isfinite(drv.q))
        assert src.replies > 1  # it did run before the bad chunk
    finally:
        node.close()
