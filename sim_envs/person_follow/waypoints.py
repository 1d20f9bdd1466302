"""Waypoints -> base twist: pure pursuit, and a wrapper that lets a policy act in waypoints.

Convention (see DESIGN.md): K robot-frame poses ``(x, y, yaw)`` at a fixed spacing of ``dt``
seconds; waypoint 0 is where the robot should be after one step, so ``|wp0| / dt`` is about
the forward speed. ``pure_pursuit`` is numpy-only: the hardware layer reuses it.
"""

from __future__ import annotations

import math

import gymnasium
import numpy as np
from gymnasium import spaces


def _wrap(a: float) -> float:
    return (a + math.pi) % (2.0 * math.pi) - math.pi


def pure_pursuit(waypoints, v_max: float, omega_max: float, dt: float, lookahead: float = 0.4) -> tuple[float, float]:
    """Twist ``(v, omega)`` that follows robot-frame ``waypoints (K, 3)``.

    Speed: the arc length to the first waypoint over ``dt`` (its chord corrected by its heading
    change), signed by whether it lies ahead or behind. Curvature: pure pursuit toward the
    first waypoint at least ``lookahead`` metres away (else the last one), ``kappa = 2 y / L^2``
    — exact for a constant-twist arc, so the twist that generated an arc is recovered.
    When the waypoints barely move (turning in place) omega comes from their headings.
    Both are scaled down together to respect the limits, keeping the curvature.
    """
    wp = np.asarray(waypoints, dtype=np.float64).reshape(-1, 3)
    if wp.shape[0] == 0 or not np.all(np.isfinite(wp)):
        raise ValueError(f"waypoints must be a finite (K, 3) array, got {wp.tolist()}")
    if not (dt > 0 and v_max > 0 and omega_max > 0 and lookahead >= 0):
        raise ValueError("pure_pursuit needs dt, v_max, omega_max > 0 and lookahead >= 0")
    x1, y1, th1 = wp[0]
    chord = math.hypot(x1, y1)
    half = 0.5 * _wrap(th1)
    arc = chord * (half / math.sin(half) if abs(half) > 1e-6 else 1.0)
    v = math.copysign(arc, x1 if abs(x1) > 1e-9 else 1.0) / dt
    dist = np.hypot(wp[:, 0], wp[:, 1])
    far = np.nonzero(dist >= lookahead)[0]
    idx = int(far[0]) if far.size else wp.shape[0] - 1
    l2 = float(dist[idx]) ** 2
    if chord < 1e-4 or l2 < 1e-8:
        v = 0.0 if chord < 1e-4 else v
        omega = _wrap(float(wp[idx, 2])) / ((idx + 1) * dt)
    else:
        kappa = 2.0 * float(wp[idx, 1]) / l2
        omega = v * kappa
    scale = min(1.0, v_max / abs(v) if abs(v) > 1e-12 else 1.0, omega_max / abs(omega) if abs(omega) > 1e-12 else 1.0)
    return float(v * scale), float(omega * scale)


def arc_waypoints(v: float, omega: float, dt: float, k: int) -> np.ndarray:
    """Robot-frame poses ``(k, 3)`` of a constant twist after 1..k steps of ``dt``."""
    t = dt * np.arange(1, k + 1)
    th = omega * t
    if abs(omega) < 1e-9:
        x, y = v * t, np.zeros_like(t)
    else:
        x = v / omega * np.sin(th)
        y = v / omega * (1.0 - np.cos(th))
    return np.stack([x, y, th], axis=1).astype(np.float32)


class WaypointFollowWrapper(gymnasium.ActionWrapper):
    """Act with K robot-frame waypoints ``(K, 3)``; pure pursuit turns them into the twist.

    The wrapped env must take a ``(v, omega)`` Box action. ``info["twist"]`` holds the twist
    that was executed.
    """

    def __init__(self, env: gymnasium.Env, num_waypoints: int = 8, dt: float | None = None, lookahead: float = 0.4):
        super().__init__(env)
        base = env.action_space
        if not (isinstance(base, spaces.Box) and base.shape == (2,)):
            raise ValueError(f"WaypointFollowWrapper needs a (v, omega) Box action space, got {base}")
        if not (isinstance(num_waypoints, int) and num_waypoints >= 1):
            raise ValueError(f"num_waypoints must be an int >= 1, got {num_waypoints!r}")
        if dt is None:
            dt = 1.0 / float(env.metadata.get("render_fps", 10))
        if not (dt > 0 and lookahead >= 0):
            raise ValueError("dt must be > 0 and lookahead >= 0")
        self.num_waypoints, self.dt, self.lookahead = num_waypoints, float(dt), float(lookahead)
        self.v_max = float(max(abs(base.low[0]), abs(base.high[0])))
        self.omega_max = float(max(abs(base.low[1]), abs(base.high[1])))
        reach = self.v_max * self.dt * num_waypoints
        yaw = max(math.pi, self.omega_max * self.dt * num_waypoints)
        high = np.tile(np.array([reach, reach, yaw], dtype=np.float32), (num_waypoints, 1))
        self.action_space = spaces.Box(-high, high, (num_waypoints, 3), np.float32)
        self._last_twist = np.zeros(2, dtype=np.float32)

    def action(self, action):
        wp = np.asarray(action, dtype=np.float64)
        if wp.shape != self.action_space.shape:
            raise ValueError(f"waypoints must have shape {self.action_space.shape}, got {wp.shape}")
        if not np.all(np.isfinite(wp)):
            raise ValueError(f"waypoints contain non-finite values: {wp.tolist()}")
        v, w = pure_pursuit(wp, self.v_max, self.omega_max, self.dt, self.lookahead)
        self._last_twist = np.array([v, w], dtype=np.float32)
        return self._last_twist.copy()

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(self.action(action))
        info["twist"] = self._last_twist.copy()
        return obs, reward, terminated, truncated, info
