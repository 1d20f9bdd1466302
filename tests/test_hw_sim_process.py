"""RealtimeSimProcess: a simulation in a spawned process, talking through one shared memory block.

The programs below are imported by the spawned child from this module (the child gets the
parent's sys.path, which holds tests/).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from hardware.drivers.base import DriverError
from hardware.drivers.sim_process import RealtimeSimProcess
from test_hw_doubles import wait_for


class EchoProgram:
    """state = command + 1 (zeros without a command); raises or hangs at a chosen step."""

    def __init__(self, dim: int = 3, fail_in_setup: bool = False, fail_at: int | None = None,
                 hang_at: int | None = None):
        self.dim, self.fail_in_setup, self.fail_at, self.hang_at = dim, fail_in_setup, fail_at, hang_at

    def setup(self):
        if self.fail_in_setup:
            raise RuntimeError("no scene to load")
        self.k = 0
        return {"hello": "world"}

    def step(self, command):
        self.k += 1
        if self.k == self.fail_at:
            raise ValueError(f"step {self.k} exploded")
        if self.k == self.hang_at:
            time.sleep(30)
        state = np.zeros(self.dim) if command is None else command + 1.0
        return state, None, ({"k": self.k, "f": np.float32(0.5)} if self.k % 10 == 0 else None)

    def teardown(self):
        pass


class RampProgram:
    """Step k: state = [k] * dim, every image filled with k % 256, info {"k": k}."""

    def __init__(self, dim: int, cameras: dict):
        self.dim, self.cameras = dim, cameras

    def setup(self):
        self.k = 0
        self.images = {name: np.zeros(shape, np.uint8) for name, shape in self.cameras.items()}
        return {}

    def step(self, command):
        self.k += 1
        for img in self.images.values():
            img.fill(self.k % 256)
        return np.full(self.dim, float(self.k)), self.images, {"k": self.k}

    def teardown(self):
        pass


def _echo(**kwargs) -> RealtimeSimProcess:
    return RealtimeSimProcess("echo", 0.002, EchoProgram, kwargs, state_dim=kwargs.get("dim", 3), command_dim=3,
                              stale_after=0.3)


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (reaping orphans is up to the container's init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _first_error(sim: RealtimeSimProcess, timeout: float = 5.0) -> DriverError:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            sim.latest()
        except DriverError as exc:
            return exc
        time.sleep(0.001)
    raise AssertionError(f"latest() kept answering for {timeout}s")


def test_command_in_state_out_and_close_cleans_up():
    sim = _echo()
    sim.start()
    try:
        pid, block = sim.pid, f"/dev/shm/{sim.shm_name}"
        assert os.path.exists(block)
        snap = sim.latest()
        assert snap.state.tolist() == [0.0, 0.0, 0.0] and snap.images == {}
        assert time.monotonic() - snap.t < 0.3
        sim.set_command(np.array([1.0, 2.0, 3.0]))
        assert wait_for(lambda: sim.latest().state.tolist() == [2.0, 3.0, 4.0], timeout=2)
        assert wait_for(lambda: sim.latest().info.get("k", 0) >= 10, timeout=2)  # setup's info replaced
        assert sim.latest().info["f"] == 0.5  # numpy scalars arrive as JSON numbers
        sim.set_command(None)
        assert wait_for(lambda: sim.latest().state.tolist() == [0.0, 0.0, 0.0], timeout=2)
        with pytest.raises(DriverError, match="command shape"):
            sim.set_command(np.zeros(2))
        assert sim.steps > 10
    finally:
        sim.close()
    assert wait_for(lambda: _gone(pid), timeout=2)  # joined: no zombie left either
    assert not os.path.exists(block)
    assert sim.steps > 10 and sim.late_steps >= 0  # the counters outlive the block
    with pytest.raises(DriverError, match="not started"):
        sim.latest()
    sim.close()  # idempotent


def test_initial_info_comes_from_setup():
    sim = _echo()
    sim.start()
    try:
        assert sim.latest().info == {"hello": "world"}
    finally:
        sim.close()


def test_error_in_a_step_surfaces_with_its_message():
    sim = _echo(fail_at=50)
    sim.start()
    pid = sim.pid
    try:
        err = _first_error(sim)
        assert "simulation process failed: ValueError('step 50 exploded')" in str(err), err
        with pytest.raises(DriverError, match="step 50 exploded"):  # and it stays failed
            sim.latest()
    finally:
        sim.close()
    assert _gone(pid)


def test_error_in_setup_fails_start_and_frees_the_block():
    sim = _echo(fail_in_setup=True)
    with pytest.raises(DriverError, match=r"failed to start: RuntimeError\('no scene to load'\)"):
        sim.start()
    assert not os.path.exists(f"/dev/shm/{sim.shm_name}") and sim.pid is None


def test_killed_child_surfaces_with_its_exit_code():
    sim = _echo()
    sim.start()
    try:
        os.kill(sim.pid, signal.SIGKILL)
        t = time.monotonic()
        err = _first_error(sim)
        assert "exited with code -9" in str(err) and time.monotonic() - t < 0.1, err
    finally:
        sim.close()
    assert not os.path.exists(f"/dev/shm/{sim.shm_name}")


def test_hung_child_is_stale_and_close_terminates_it():
    sim = _echo(hang_at=20)
    sim.start()
    pid = sim.pid
    try:
        assert "simulation stalled" in str(_first_error(sim)), "stale"
    finally:
        t = time.monotonic()
        sim.close(timeout=0.2)
    assert time.monotonic() - t < 2 and _gone(pid)
    assert not os.path.exists(f"/dev/shm/{sim.shm_name}")


def test_snapshots_are_never_torn():
    cameras = {"a": (120, 160, 3), "b": (60, 80, 3)}
    sim = RealtimeSimProcess("ramp", 0.001, RampProgram, {"dim": 16, "cameras": cameras}, state_dim=16,
                             command_dim=1, cameras=cameras)
    sim.start()
    try:
        seen = set()
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            snap = sim.latest()
            k = snap.state[0]
            assert np.all(snap.state == k)
            assert snap.info["k"] == k
            for name, img in snap.images.items():
                assert img.shape == cameras[name] and img.min() == img.max() == int(k) % 256, (name, k)
            seen.add(k)
        assert len(seen) > 100, len(seen)
    finally:
        sim.close()


_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from hardware.drivers.sim_process import RealtimeSimProcess
    from test_hw_sim_process import EchoProgram

    if __name__ == "__main__":
        sim = RealtimeSimProcess("echo", 0.002, EchoProgram, state_dim=3, command_dim=3)
        sim.start()
        sim.set_command(np.ones(3))
        sim.latest()
        if sys.argv[1] == "orphan":  # die without cleaning up: the child must notice
            print(sim.pid, sim.shm_name, flush=True)
            os._exit(0)
        if sys.argv[1] == "killed":
            os.kill(sim.pid, 9)
            time.sleep(0.1)
        sim.close()
        print("ok", flush=True)
""")


def _script(tmp_path, mode: str) -> subprocess.CompletedProcess:
    path = tmp_path / "sim_script.py"
    path.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.getcwd()]))
    return subprocess.run([sys.executable, str(path), mode], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("mode", ["closed", "killed"])
def test_no_resource_tracker_complaints_at_exit(tmp_path, mode):
    out = _script(tmp_path, mode)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr and "KeyError" not in out.stderr, out.stderr


def test_child_exits_when_its_parent_is_gone(tmp_path):
    out = _script(tmp_path, "orphan")
    pid, name = out.stdout.split()
    assert wait_for(lambda: _gone(int(pid)), timeout=5)
    # With every user gone, the resource tracker unlinks the block (and says so).
    assert wait_for(lambda: not os.path.exists(f"/dev/shm/{name}"), timeout=5)
