"""Action sources: where the node's chunks come from (a policy worker process, or anything
that implements the same five calls: teleop, replay, a test double)."""

from __future__ import annotations

import math
import signal
import subprocess
import time
from collections import deque
from typing import Any, Protocol, Sequence

import numpy as np

from hardware.control.scheduler import Chunk
from hardware.transport.messages import Message
from hardware.transport.zmq_link import PolicyClient


class ActionSource(Protocol):
    def start(self) -> None: ...

    def wants_observation(self, now: float) -> bool:
        """True when an observation should be sent now (rate and in-flight limits)."""
        ...

    def submit(self, obs: dict[str, Any], t_obs: float) -> None: ...

    def poll(self, now: float) -> list[Chunk]:
        """Chunks that arrived since the last call; never blocks."""
        ...

    def health(self, now: float) -> str | None:
        """None when fine, else why the source can no longer be trusted (→ latched fault)."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    # Optional: ``restart_silence_clock()`` — called by the node when a fault is reset. While a
    # fault is latched the node sends nothing, so a source that watches for silence must not count
    # that time against the policy.


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class PolicyWorkerSource:
    """Talks to a policy worker over :class:`PolicyClient`; optionally launches it.

    ``command``: argv of the worker process to launch (it must bind ``endpoint``), or None to
    connect to a worker that already runs (possibly on another machine).
    One observation is in flight at a time, sent at most at ``request_hz``; a request unanswered
    after ``request_timeout`` is given up (counted) so a lost message cannot stall the stream.
    """

    def __init__(
        self,
        endpoint: str,
        command: Sequence[str] | None = None,
        key: bytes | None = None,
        request_hz: float = 20.0,
        request_timeout: float = 1.0,
        silence_timeout: float = 2.0,
        obs_keys: Sequence[str] | None = None,
        insecure_loopback: bool = False,
        encrypt: bool | None = None,
    ):
        self.endpoint, self.command, self.key = endpoint, list(command) if command else None, key
        self.insecure_loopback, self.encrypt = insecure_loopback, encrypt
        self.request_period = 1.0 / float(request_hz)
        self.request_timeout, self.silence_timeout = float(request_timeout), float(silence_timeout)
        self.obs_keys = set(obs_keys) if obs_keys else None
        self.proc: subprocess.Popen | None = None
        self.client: PolicyClient | None = None
        self._seq = 0
        self._in_flight: tuple[int, float] | None = None  # (seq, time sent)
        self._next_request = 0.0
        self._last_reply = math.nan
        self.round_trips: deque[float] = deque(maxlen=4096)
        self.infer_ms: deque[float] = deque(maxlen=4096)
        self.sent = self.replies = self.errors = self.timeouts = self.stale = 0
        self.last_error = ""
        self.refused: str | None = None

    def start(self) -> None:
        if self.command:
            self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL)
        self.client = PolicyClient(self.endpoint, self.key, insecure_loopback=self.insecure_loopback, encrypt=self.encrypt)
        # A worker may outlive a session (started elsewhere, or serving several runs): every
        # session starts from a fresh temporal context.
        self.client.send(Message("reset", 0, time.monotonic()))

    def wants_observation(self, now: float) -> bool:
        if now < self._next_request:
            return False
        if self._in_flight is not None and now - self._in_flight[1] < self.request_timeout:
            return False
        return True

    def submit(self, obs: dict[str, Any], t_obs: float) -> None:
        arrays, meta = {}, {}
        for k, v in obs.items():
            if self.obs_keys is not None and k not in self.obs_keys:
                continue
            if isinstance(v, np.ndarray):
                arrays[k] = v
            elif isinstance(v, (str, int, float, bool)):
                meta[k] = v
        if self._in_flight is not None:
            self.timeouts += 1
        self._seq += 1
        if self.client.send(Message("obs", self._seq, t_obs, arrays, meta)):
            self._in_flight = (self._seq, time.monotonic())
            self.sent += 1
        self._next_request = t_obs + self.request_period

    def poll(self, now: float) -> list[Chunk]:
        out = []
        for msg in self.client.poll():
            matched = self._in_flight is not None and msg.seq == self._in_flight[0]
            if matched:
                self.round_trips.append(now - self._in_flight[1])
                self._in_flight = None
            if msg.kind == "error":
                self.errors += 1
                self.last_error = str(msg.meta.get("reason", ""))[:200]
                if msg.meta.get("refused") is True:
                    self.refused = self.last_error  # the worker serves another node: no chunk will come
                continue
            if msg.kind != "chunk":
                continue
            if not matched:
                self.stale += 1  # an answer to a request we gave up on: still usable, it is time-stamped
            name = "waypoints" if "waypoints" in msg.arrays else "action"
            values = msg.arrays.get(name)
            dt = msg.meta.get("dt")
            if values is None or values.ndim != 2 or not isinstance(dt, (int, float)) or not dt > 0:
                self.errors += 1
                self.last_error = "chunk without a (H, A) 'action' or (K, 3) 'waypoints' array and a dt"
                continue
            self.replies += 1
            self._last_reply = now
            if isinstance(msg.meta.get("infer_ms"), (int, float)):
                self.infer_ms.append(float(msg.meta["infer_ms"]))
            out.append(Chunk(values, msg.t, float(dt), name, now, msg.seq, dict(msg.meta)))
        return out

    def health(self, now: float) -> str | None:
        if self.client is not None:
            problem = self.client.handshake_problem()
            if problem is not None:
                return problem
        if self.refused is not None:
            return f"policy worker {self.refused}"
        if self.proc is not None:
            code = self.proc.poll()
            if code is not None:
                return f"policy worker {_describe_exit(code)}"
        if self.replies and now - self._last_reply > self.silence_timeout:
            return f"policy worker silent for {now - self._last_reply:.2f}s"
        return None

    def restart_silence_clock(self) -> None:
        """Forget when the last reply came: silence is counted again from the next reply."""
        self._last_reply = math.nan

    def stats(self) -> dict[str, Any]:
        rt = np.array(self.round_trips) * 1e3
        inf = np.array(self.infer_ms)
        return {
            "sent": self.sent, "replies": self.replies, "errors": self.errors, "timeouts": self.timeouts,
            "stale_replies": self.stale, "last_error": self.last_error,
            "round_trip_ms": {"p50": float(np.median(rt)) if len(rt) else None, "p99": float(np.percentile(rt, 99)) if len(rt) else None},
            "infer_ms": {"p50": float(np.median(inf)) if len(inf) else None, "last": float(inf[-1]) if len(inf) else None},
            "transport": self.client.stats() if self.client is not None else {},
        }

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(3.0)
