"""Test doubles shared by the hardware tests (no tests here): a numpy point-mass arm and a scripted source."""

from __future__ import annotations

import threading
import time

import numpy as np

from hardware.control.scheduler import Chunk
from hardware.drivers.base import DriverSpec


class PointDriver:
    """An arm whose joints jump to the command; records every stop() with its time."""

    def __init__(self, dim: int = 3, rate_hz: float = 500.0, kind: str = "arm"):
        self.spec = DriverSpec(kind, tuple(f"j{i}" for i in range(dim)), -np.ones(dim) * 2, np.ones(dim) * 2,
                               max_rate=50.0, command_timeout=0.5, rate_hz=rate_hz)
        self.q = np.zeros(dim)
        self.stops: list[float] = []
        self.writes = 0
        self.fail_read = False
        self.hang = threading.Event()  # set → read() blocks until released
        self.read_delay = 0.0  # a bus read that takes this long (releases the GIL, as I/O does)
        self.release = threading.Event()

    def connect(self):
        pass

    def disconnect(self):
        self.release.set()

    def read(self):
        if self.fail_read:
            raise IOError("bus timeout (injected)")
        if self.hang.is_set():
            self.release.wait(5.0)
        if self.read_delay:
            time.sleep(self.read_delay)
        return {"observation.state": self.q.copy()}

    def write(self, command):
        self.q = np.asarray(command, float).copy()
        self.writes += 1
        return self.q.copy()

    def stop(self):
        self.stops.append(time.monotonic())


class ScriptSource:
    """Serves chunks computed in-process from each observation (``fn(state, t) -> (H, A)``)."""

    def __init__(self, fn, dt: float = 0.05, every: float = 0.05):
        self.fn, self.dt, self.every = fn, dt, every
        self.pending: list[Chunk] = []
        self.next = 0.0
        self.dead: str | None = None
        self.submitted = 0

    def start(self):
        pass

    def wants_observation(self, now):
        return now >= self.next

    def submit(self, obs, t_obs):
        self.next = t_obs + self.every
        self.submitted += 1
        self.pending.append(Chunk(np.asarray(self.fn(obs["observation.state"], t_obs), float), t_obs, self.dt))

    def poll(self, now):
        out, self.pending = self.pending, []
        return out

    def health(self, now):
        return self.dead

    def stats(self):
        return {}

    def close(self):
        pass


def wait_for(pred, timeout: float = 5.0, step: float = 0.005) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()
