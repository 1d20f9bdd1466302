"""TeleopSource: a teleoperator as the control node's :class:`~hardware.control.source.ActionSource`,
alone or beside a policy it can take over from (HG-DAgger interventions).

A reader thread reads the device at ``rate_hz`` (a bus read or a listener never runs in the
control loop) and maps each reading to a target through the :class:`ActionAdapter`. The node's
thread (:meth:`poll`) turns targets into chunks ``[in force, next, next, ...]``: one device period
to reach ``next`` (the 500 Hz loop interpolates between reads), then held until the next read's
chunk supersedes it.

Hand-over without a jump. Every operator chunk moves from the command in force toward the
operator's target by at most ``max_speed * dt`` (a leader arm held elsewhere than the follower
is approached, not jumped to), and when control goes back to the policy its chunks are rate
limited the same way from the command in force until they are caught up with. With
``max_speed`` at most the safety filter's step limit times the node's rate, a hand-over never
asks for a larger step than the filter allows. The node must use a ``latest`` scheduler (the
newest chunk commands alone): an ensemble would keep voting for the policy's older chunks.

Events (:data:`hardware.teleop.base.EVENTS`) are queued for the recording loop
(:meth:`take_events`); ``intervene`` (held) or ``toggle`` switch who drives when a policy is
attached. A device that fails or disconnects makes :meth:`health` report it: the node latches a
fault and commands the safe stop in the same tick.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import numpy as np

from hardware.control.scheduler import ActionScheduler, Chunk
from hardware.teleop.adapter import ActionAdapter
from hardware.teleop.base import Teleop, TeleopReading


def limited_path(start: np.ndarray, values: np.ndarray, max_steps: np.ndarray) -> np.ndarray:
    """``values (H, A)`` followed from ``start`` with step ``i``'s change clipped to
    ``max_steps[i]`` (a scalar or ``(A,)`` per step); returns the path ``(H, A)``."""
    out = np.empty(np.shape(values), dtype=np.float64)
    p = np.asarray(start, np.float64).copy()
    for i, v in enumerate(values):
        p = p + np.clip(v - p, -max_steps[i], max_steps[i])
        out[i] = p
    return out


class TeleopSource:
    """``device`` (connected or not) → chunks for the node; ``policy``: an ActionSource that drives
    until the operator takes over (None: the operator always drives).

    ``max_speed``: the largest change of any command value per second on operator chunks and
    on the policy's chunks after a give-back (see the module docstring).
    """

    def __init__(self, device: Teleop, adapter: ActionAdapter, rate_hz: float = 30.0,
                 max_speed: float | np.ndarray = np.inf, policy: Any = None,
                 silence_timeout: float = 1.0):
        self.device, self.adapter, self.policy = device, adapter, policy
        self.period = 1.0 / float(rate_hz)
        self.max_speed = np.asarray(max_speed, float)
        self.silence_timeout = float(silence_timeout)
        self._hold_steps = max(1, int(math.ceil(self.silence_timeout / self.period)))
        self.kind = "action"
        self._lock = threading.Lock()
        self._obs: dict[str, Any] | None = None
        self._target: np.ndarray | None = None  # operator's latest target
        self._target_new = False
        self._base: np.ndarray | None = None  # delta devices integrate from here (reset at hand-over)
        self._events: list[tuple[str, float]] = []
        self._thread: threading.Thread | None = None
        self._running = threading.Event()
        self.problem: str | None = None
        self.reads = 0
        self._last_read = math.nan
        self.operator_driving = policy is None
        self._toggled = False
        self._held = False
        self.handovers = 0
        self._catching_up = False  # policy chunks still rate-limited after a give-back
        # mirror of the chunks handed to the node; between chunks the node holds the last command,
        # and so does the mirror (hold_last)
        self.executed = ActionScheduler("latest", hold_last=1e9)
        self.proposed = ActionScheduler("latest")  # the policy's own chunks (its proposal)
        self._state: np.ndarray | None = None

    # -- ActionSource ------------------------------------------------------------------------
    def start(self) -> None:
        if not self.device.is_connected:
            self.device.connect()
        if self.policy is not None:
            self.policy.start()
        self._running.set()
        self._thread = threading.Thread(target=self._read_loop, name="teleop-reader", daemon=True)
        self._thread.start()

    def wants_observation(self, now: float) -> bool:
        return True

    def submit(self, obs: dict[str, Any], t_obs: float) -> None:
        self._obs = obs  # a reference: the reader thread looks at the newest one
        if self._state is None:
            self._state = (np.zeros(self.adapter.spec.dim) if self.adapter.spec.kind == "base"
                           else np.asarray(obs["observation.state"], float).copy())
        if self.policy is not None and self.policy.wants_observation(t_obs):
            self.policy.submit(obs, t_obs)

    def in_force(self, t: float) -> np.ndarray | None:
        """The command the node executes at ``t`` from this source's chunks (None before any)."""
        cmd = self.executed.command_at(t)
        if cmd is None and self._state is not None:
            return self._state
        return cmd

    def proposal(self, t: float) -> np.ndarray | None:
        """The policy's proposed command at ``t`` (None without a policy or before its first chunk)."""
        return self.proposed.command_at(t) if self.policy is not None else None

    def poll(self, now: float) -> list[Chunk]:
        out: list[Chunk] = []
        policy_chunks = self.policy.poll(now) if self.policy is not None else []
        for c in policy_chunks:
            self.proposed.add(c, now)
        self._update_driver(now)
        if self.operator_driving:
            with self._lock:
                target, fresh = self._target, self._target_new
                self._target_new = False
            start = self.in_force(now)
            if fresh and target is not None and start is not None:
                values = limited_path(start, target[None], [self.max_speed * self.period])
                # held until the next read supersedes it: an older policy chunk must never show
                # through a gap between two reads
                hold = np.repeat(values, self._hold_steps, axis=0)
                out.append(Chunk(np.concatenate([start[None], hold]), now, self.period, self.kind, now))
        else:
            for c in policy_chunks:
                if self._catching_up:
                    c = self._catch_up(c, now)
                out.append(c)
        for c in out:
            self.executed.add(c, now)
        return out

    def _catch_up(self, c: Chunk, now: float) -> Chunk:
        """The policy's chunk ``c`` followed from the command in force at ``now``, at most
        ``max_speed``; the catching up ends once the command in force is on the policy's plan."""
        start = self.in_force(now)
        vals = np.asarray(c.values, float)
        late = max(0, int(math.floor((now - c.t_obs) / c.dt)))  # steps at or before now
        if start is None or late + 1 >= len(vals):
            return c
        raw_now = vals[late] + (vals[late + 1] - vals[late]) * ((now - c.t_obs) / c.dt - late)
        if np.allclose(start, raw_now, atol=1e-6):
            self._catching_up = False
            return c
        # the step after ``now`` is reached from ``start`` in what is left of its interval
        spans = np.full(len(vals) - late - 1, c.dt)
        spans[0] = c.t_obs + (late + 1) * c.dt - now
        tail = limited_path(start, vals[late + 1:], self.max_speed * spans[:, None] * np.ones_like(vals[late + 1:]))
        # the step at or before ``now`` is put where the line through ``start`` (at ``now``) and the
        # next step comes from, so the node's interpolation gives exactly ``start`` at ``now``
        before = now - (c.t_obs + late * c.dt)
        head = np.repeat((start - (tail[0] - start) * before / spans[0])[None], late + 1, axis=0)
        return Chunk(np.concatenate([head, tail]), c.t_obs, c.dt, c.kind, c.t_received, c.seq, c.meta)

    def _update_driver(self, now: float) -> None:
        """Who drives now: the operator's held button or toggle (always the operator alone)."""
        if self.policy is None:
            return
        with self._lock:
            want = self._held or self._toggled
        if want and not self.operator_driving:
            base = self.in_force(now)
            with self._lock:
                self._base = None if base is None else base.copy()
                self._target, self._target_new = None, False  # never act on a target from before
            self.operator_driving = True
            self.handovers += 1
        elif not want and self.operator_driving:
            self.operator_driving = False
            self._catching_up = True
            self.handovers += 1

    def health(self, now: float) -> str | None:
        if self.problem is not None:
            return self.problem
        if self.reads and now - self._last_read > self.silence_timeout:
            return f"teleop device {self.device.name} silent for {now - self._last_read:.2f}s"
        if self.policy is not None:
            return self.policy.health(now)
        return None

    def stats(self) -> dict[str, Any]:
        out = {"device": self.device.name, "reads": self.reads, "handovers": self.handovers,
               "operator_driving": self.operator_driving, "problem": self.problem}
        if self.policy is not None:
            out["policy"] = self.policy.stats()
        return out

    def close(self) -> None:
        self._running.clear()
        if self._thread is not None:
            self._thread.join(2.0)
        try:
            self.device.disconnect()
        except Exception as exc:  # noqa: BLE001 - closing: say it, do not mask the session's end
            self.problem = self.problem or f"teleop device {self.device.name}: disconnect raised {exc!r}"
        if self.policy is not None:
            self.policy.close()

    # -- recording loop API ----------------------------------------------------------------
    def take_events(self) -> list[tuple[str, float]]:
        """``(event, time of the read)`` since the last call, in order (save, rerecord, discard,
        stop, success, failure)."""
        with self._lock:
            out, self._events = self._events, []
        return out

    @property
    def intervening(self) -> bool:
        """True while the operator drives and a policy is attached (an intervention)."""
        return self.policy is not None and self.operator_driving

    # -- reader thread ---------------------------------------------------------------------
    def _read_loop(self) -> None:
        next_t = time.monotonic()
        while self._running.is_set():
            try:
                reading = self.device.read(self._obs)
                self._take(reading)
            except Exception as exc:  # noqa: BLE001 - any device failure stops the robot via health()
                self.problem = f"teleop device {self.device.name} disconnected: {exc}"
                return
            next_t += self.period
            time.sleep(max(0.0, next_t - time.monotonic()))

    def _take(self, reading: TeleopReading) -> None:
        self.reads += 1
        self._last_read = time.monotonic()
        with self._lock:
            if "toggle" in reading.events:
                self._toggled = not self._toggled
            self._held = "intervene" in reading.events
            t = reading.t or time.monotonic()
            # one read's events in the order they act: a mark, then what ends the episode, then stop
            order = {"success": 0, "failure": 0, "stop": 2}
            self._events.extend((e, t) for e in sorted(reading.events, key=lambda e: order.get(e, 1))
                                if e not in ("intervene", "toggle"))
            base = self._base
        if base is None and self._state is not None:
            base = self._state.copy()
        if base is None:
            return  # no observation yet: nothing to move from
        target = self.adapter(reading, base)
        with self._lock:
            self._base = target if reading.kind == "delta" else self._base
            self._target, self._target_new = target, True
