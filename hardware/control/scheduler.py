"""ActionScheduler (time-stamped action chunks → a command at any instant) and WaypointFollower.

Time: every chunk is anchored at ``t_obs``, the node's monotonic time of the observation it was
computed from; step ``i`` is meant for ``t_obs + i * dt``. When a chunk arrives, the steps whose
time has already passed are dropped (latency compensation) and counted. Between steps the
command is interpolated linearly, so a 20 Hz policy drives a 500 Hz loop smoothly.

Blending overlapping chunks:

* ``"ensemble"`` — temporal ensembling (ACT): every chunk covering ``t`` votes with weight
  ``exp(-k * i)``, ``i = 0`` for the oldest chunk (older predictions count more; larger ``k``
  trusts the oldest even more).
* ``"rtc"`` — real-time-chunking crossfade: the newest chunk takes over from the previous
  plan over ``crossfade`` seconds after it arrives (linear weight ramp), so the in-flight plan
  is never cut off abruptly.
* ``"latest"`` — the newest chunk only.

The blend weights are :mod:`hardware.control.chunking`'s, the step executor that evaluation and
refinement use; here they apply in continuous time, between interpolated steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from hardware.control.chunking import crossfade_weights, ensemble_weights

BLENDS = ("ensemble", "rtc", "latest")


@dataclass
class Chunk:
    """``values (H, A)`` for steps at ``t_obs + i * dt``; ``kind``: "action" or "waypoints"."""

    values: np.ndarray
    t_obs: float
    dt: float
    kind: str = "action"
    t_received: float = 0.0
    seq: int = 0
    meta: dict = field(default_factory=dict)

    @property
    def t_end(self) -> float:
        return self.t_obs + (len(self.values) - 1) * self.dt


def _interp(values: np.ndarray, t0: float, dt: float, t: float) -> np.ndarray:
    """Linear interpolation of the step sequence ``values`` (steps at t0 + i*dt) at time t."""
    x = (t - t0) / dt
    if x <= 0:
        return values[0]
    i = int(x)
    if i >= len(values) - 1:
        return values[-1]
    f = x - i
    return values[i] * (1.0 - f) + values[i + 1] * f


class ActionScheduler:
    """Holds time-stamped chunks; :meth:`command_at` gives the blended command for time ``t``.

    The chunks' steps live in one ``(max_chunks, H, A)`` ring buffer, so blending any number of
    overlapping chunks costs one gather and one dot product per tick (a per-chunk loop of small
    numpy operations cost 105–145 µs per tick with ten chunks in flight, on 2 CPU cores).
    """

    def __init__(self, blend: str = "ensemble", ensemble_k: float = 0.01, crossfade: float = 0.1,
                 max_chunks: int = 10, hold_last: float = 0.0):
        if blend not in BLENDS:
            raise ValueError(f"blend must be one of {BLENDS}, got {blend!r}")
        if ensemble_k < 0 or crossfade < 0 or hold_last < 0:
            raise ValueError("ensemble_k, crossfade and hold_last must be >= 0")
        if max_chunks < 1:
            raise ValueError("max_chunks must be >= 1")
        self.blend, self.k, self.crossfade, self.hold_last = blend, float(ensemble_k), float(crossfade), float(hold_last)
        self.max_chunks = int(max_chunks)
        self.chunks: deque[_Active] = deque(maxlen=self.max_chunks)
        # ensemble weights exp(-k i), normalised, for each number of covering chunks
        self._ens = [[]] + [ensemble_weights(n, self.k).tolist() for n in range(1, self.max_chunks + 1)]
        self._buf: np.ndarray | None = None  # (max_chunks, H, A) steps of the live chunks
        self._slot = 0
        self.dropped_steps = 0
        self.dropped_chunks = 0
        self.received = 0
        self.last_fresh = -math.inf  # time the newest accepted chunk arrived

    def reset(self) -> None:
        self.chunks.clear()
        self.last_fresh = -math.inf

    def _store(self, values: np.ndarray) -> int:
        """Copy ``values (h, A)`` into the next ring slot (the slot of the chunk the deque evicts)."""
        h, a = values.shape
        buf = self._buf
        if buf is None or buf.shape[2] != a:
            if buf is not None and self.chunks:
                raise ValueError(f"chunk action size {a} != {buf.shape[2]} of the chunks in flight")
            self._buf = buf = np.zeros((self.max_chunks, h, a))
        elif buf.shape[1] < h:  # a longer chunk than any before: grow, keeping the live steps
            grown = np.zeros((self.max_chunks, h, a))
            grown[:, : buf.shape[1]] = buf
            self._buf = buf = grown
        slot = self._slot
        self._slot = (slot + 1) % self.max_chunks
        buf[slot, :h] = values
        return slot

    def add(self, chunk: Chunk, now: float) -> int:
        """Accept ``chunk`` at time ``now``; returns how many of its steps were already late."""
        values = np.asarray(chunk.values, dtype=np.float64)
        if values.ndim != 2 or len(values) == 0:
            raise ValueError(f"a chunk must be (H, A) with H >= 1, got shape {values.shape}")
        if not chunk.dt > 0:
            raise ValueError("chunk dt must be > 0")
        self.received += 1
        # Steps strictly before the previous step boundary are late: drop them, but keep one step
        # before `now` so interpolation starts from where the plan is at `now`.
        late = int(math.floor((now - chunk.t_obs) / chunk.dt))
        late = max(0, min(late, len(values)))
        if late >= len(values):
            self.dropped_steps += len(values)
            self.dropped_chunks += 1
            return len(values)
        self.dropped_steps += late
        kept = values[late:]
        slot = self._store(kept)
        self.chunks.append(_Active(kept, chunk.t_obs + late * chunk.dt, float(chunk.dt), now, slot))
        self.last_fresh = now
        return late

    def _covering(self, t: float) -> list[_Active]:
        chunks = self.chunks
        while len(chunks) > 1 and chunks[0].t_end + self.hold_last < t:
            chunks.popleft()  # expired (keep the newest as the fallback plan)
        lo, hi = t + 1e-9, t - self.hold_last - 1e-9
        return [c for c in chunks if c.t0 <= lo and c.t_end >= hi]

    def command_at(self, t: float) -> np.ndarray | None:
        """The blended command for time ``t``, or None when no chunk covers ``t``."""
        active = self._covering(t)
        n = len(active)
        if n == 0:
            return None
        if self.blend == "latest" or n == 1:
            return _interp(active[-1].values, active[-1].t0, active[-1].dt, t)
        if self.blend == "ensemble":
            weights = self._ens[n]  # oldest first
        else:  # rtc crossfade: each plan takes over from the older ones over ``crossfade`` s after it arrived
            cf = self.crossfade
            weights = crossfade_weights([1.0 if cf == 0 else (t - c.t_arrived) / cf for c in active])
        # every chunk is linear between its steps: weight (1-f) on step i, f on step i+1
        h = self._buf.shape[1]
        idx, coef = [], []
        for c, w in zip(active, weights):
            x = (t - c.t0) / c.dt
            last = c.n - 1
            base = c.slot * h
            if x <= 0.0:
                i, f = 0, 0.0
            else:
                i = int(x)
                f = x - i
                if i >= last:
                    i, f = last, 0.0
            idx += (base + i, base + min(i + 1, last))
            coef += (w * (1.0 - f), w * f)
        return np.dot(coef, self._buf.reshape(-1, self._buf.shape[2]).take(idx, 0))

    def planned(self, t: float, n: int, dt: float) -> np.ndarray | None:
        """The next ``n`` commands at spacing ``dt`` from ``t`` (the in-flight plan, for RTC
        conditioning of the next inference), or None when nothing is planned."""
        rows = [self.command_at(t + i * dt) for i in range(n)]
        if rows[0] is None:
            return None
        last = rows[0]
        out = []
        for r in rows:
            last = r if r is not None else last
            out.append(last)
        return np.stack(out)


class _Active:
    """A chunk in flight: its kept steps (also in the scheduler's ring buffer at ``slot``)."""

    __slots__ = ("values", "t0", "dt", "t_arrived", "slot", "n", "t_end")

    def __init__(self, values: np.ndarray, t0: float, dt: float, t_arrived: float, slot: int):
        self.values, self.t0, self.dt, self.t_arrived, self.slot = values, t0, dt, t_arrived, slot
        self.n = len(values)
        self.t_end = t0 + (self.n - 1) * dt


class WaypointFollower:
    """Robot-frame waypoints ``(K, 3)`` → twist ``(v, omega)`` at control rate by pure pursuit.

    Waypoints are stated in the robot frame at ``t_obs``; the follower keeps a short odometry
    history (integrated from the twists actually sent), so a late set is re-expressed in the
    robot's current frame and the waypoints whose time has passed are skipped.
    """

    def __init__(self, v_max: float, omega_max: float, lookahead: float = 0.4, history_s: float = 5.0):
        from sim_envs.person_follow.waypoints import pure_pursuit  # numpy-only

        self._pure_pursuit = pure_pursuit
        self.v_max, self.omega_max, self.lookahead = float(v_max), float(omega_max), float(lookahead)
        self.pose = np.zeros(3)  # odometry frame
        self.t_pose = None
        self._history: deque[tuple[float, np.ndarray]] = deque()
        self.history_s = float(history_s)
        self._plan: tuple[np.ndarray, float, float] | None = None  # (odom-frame waypoints, t_obs, dt)
        self.dropped_steps = 0
        self.received = 0
        self.last_fresh = -math.inf

    def reset(self) -> None:
        self._plan = None
        self.last_fresh = -math.inf

    def integrate(self, twist: np.ndarray, t: float) -> None:
        """Advance odometry to ``t`` with the twist that was in force since the last call."""
        if self.t_pose is not None:
            h = t - self.t_pose
            v, w = float(twist[0]), float(twist[1])
            x, y, th = self.pose
            self.pose = np.array([x + v * h * math.cos(th + 0.5 * w * h), y + v * h * math.sin(th + 0.5 * w * h), th + w * h])
        self.t_pose = t
        self._history.append((t, self.pose.copy()))
        while self._history and self._history[0][0] < t - self.history_s:
            self._history.popleft()

    def _pose_at(self, t: float) -> np.ndarray:
        for tt, p in reversed(self._history):
            if tt <= t:
                return p
        return self._history[0][1] if self._history else self.pose

    def add(self, chunk: Chunk, now: float) -> int:
        wp = np.asarray(chunk.values, dtype=np.float64)
        if wp.ndim != 2 or wp.shape[1] != 3 or len(wp) == 0:
            raise ValueError(f"waypoints must be (K, 3), got {wp.shape}")
        self.received += 1
        ox, oy, oth = self._pose_at(chunk.t_obs)
        c, s = math.cos(oth), math.sin(oth)
        odom = np.stack([ox + c * wp[:, 0] - s * wp[:, 1], oy + s * wp[:, 0] + c * wp[:, 1], oth + wp[:, 2]], axis=1)
        self._plan = (odom, chunk.t_obs, chunk.dt)
        self.last_fresh = now
        late = max(0, min(len(wp), int(math.floor((now - chunk.t_obs) / chunk.dt))))
        self.dropped_steps += late
        return late

    def command_at(self, t: float) -> np.ndarray | None:
        if self._plan is None:
            return None
        odom, t_obs, dt = self._plan
        first = int(math.floor((t - t_obs) / dt))  # waypoint i is for t_obs + (i + 1) * dt
        first = max(0, first)
        if first >= len(odom):
            return None
        x, y, th = self.pose
        c, s = math.cos(th), math.sin(th)
        rest = odom[first:]
        dx, dy = rest[:, 0] - x, rest[:, 1] - y
        robot = np.stack([c * dx + s * dy, -s * dx + c * dy, rest[:, 2] - th], axis=1)
        # the first remaining waypoint is due (first + 1) * dt after t_obs: rescale to the time left
        due = t_obs + (first + 1) * dt - t
        v, w = self._pure_pursuit(robot, self.v_max, self.omega_max, max(due, 0.25 * dt), self.lookahead)
        return np.array([v, w])
