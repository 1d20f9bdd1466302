"""2-D geometry shared by the scene generator, the env and the oracle (numpy only).

Obstacles are rows ``(x, y, yaw, hx, hy, kind[, height])``: kind 0 is a box footprint with
half extents ``hx, hy`` rotated by ``yaw``; kind 1 is a cylinder of radius ``hx``.
"""

from __future__ import annotations

import numpy as np

OBSTACLE_FIELDS = ("x", "y", "yaw", "hx", "hy", "kind", "height")
BOX, CYLINDER = 0.0, 1.0


def wrap_angle(a):
    """Angle(s) wrapped to [-pi, pi)."""
    return (np.asarray(a) + np.pi) % (2.0 * np.pi) - np.pi


def obstacle_distance(points: np.ndarray, obstacles: np.ndarray) -> np.ndarray:
    """Signed distance from points ``(..., 2)`` to each obstacle footprint: ``(..., M)``.

    Negative inside. ``obstacles`` holds only active rows, shape ``(M, 6)``.
    """
    pts = np.asarray(points, dtype=np.float64)
    obs = np.asarray(obstacles, dtype=np.float64)
    obs = obs.reshape(-1, obs.shape[-1] if obs.ndim else 6)
    if obs.shape[0] == 0:
        return np.full(pts.shape[:-1] + (0,), np.inf)
    dx = pts[..., None, 0] - obs[:, 0]
    dy = pts[..., None, 1] - obs[:, 1]
    c, s = np.cos(obs[:, 2]), np.sin(obs[:, 2])
    lx = np.abs(c * dx + s * dy) - obs[:, 3]
    ly = np.abs(-s * dx + c * dy) - obs[:, 4]
    outside = np.hypot(np.maximum(lx, 0.0), np.maximum(ly, 0.0))
    inside = np.minimum(np.maximum(lx, ly), 0.0)
    box = outside + inside
    cyl = np.hypot(dx, dy) - obs[:, 3]
    return np.where(obs[:, 5] == CYLINDER, cyl, box)


def wall_distance(points: np.ndarray, room_half: float) -> np.ndarray:
    """Distance from points ``(..., 2)`` to the nearest inner wall face (negative outside)."""
    pts = np.asarray(points, dtype=np.float64)
    return room_half - np.max(np.abs(pts), axis=-1)


def clearance(points: np.ndarray, obstacles: np.ndarray, room_half: float) -> np.ndarray:
    """Distance from points ``(..., 2)`` to the nearest obstacle footprint or wall."""
    d = wall_distance(points, room_half)
    od = obstacle_distance(points, obstacles)
    if od.shape[-1]:
        d = np.minimum(d, od.min(axis=-1))
    return d


def nearest_hazard(pose: np.ndarray, radius: float, obstacles: np.ndarray, room_half: float,
                   samples: int = 72) -> tuple[np.ndarray, float]:
    """The point of the obstacle or wall nearest a round robot's rim at ``pose (x, y, yaw)``, and
    the rim's clearance to it: the rim point of least clearance, pushed out by that clearance
    along the rim's normal (an approximation to ``2 pi radius / samples`` along the rim)."""
    pose = np.asarray(pose, dtype=np.float64)
    ang = pose[2] + np.linspace(-np.pi, np.pi, samples, endpoint=False)
    normal = np.stack([np.cos(ang), np.sin(ang)], axis=-1)
    d = clearance(pose[:2] + radius * normal, obstacles, room_half)
    i = int(np.argmin(d))
    return pose[:2] + (radius + max(float(d[i]), 0.0)) * normal[i], float(d[i])


def segment_point_distance(a: np.ndarray, b: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Distance from points ``p (..., 2)`` to segments ``a->b`` (broadcast)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    ab = b - a
    denom = np.maximum(np.sum(ab * ab, axis=-1), 1e-12)
    t = np.clip(np.sum((p - a) * ab, axis=-1) / denom, 0.0, 1.0)
    proj = a + t[..., None] * ab
    return np.linalg.norm(p - proj, axis=-1)


def to_robot_frame(pose: np.ndarray, points: np.ndarray) -> np.ndarray:
    """World points ``(..., 2)`` expressed in the frame of ``pose = (x, y, yaw)``."""
    x, y, yaw = float(pose[0]), float(pose[1]), float(pose[2])
    c, s = np.cos(yaw), np.sin(yaw)
    d = np.asarray(points, dtype=np.float64) - np.array([x, y])
    return np.stack([c * d[..., 0] + s * d[..., 1], -s * d[..., 0] + c * d[..., 1]], axis=-1)


def free_run(pose: np.ndarray, radius: float, obstacles: np.ndarray, room_half: float, max_range: float,
             bearings=(0.0,), step: float = 0.02) -> np.ndarray:
    """How far a round robot of ``radius`` at ``pose (x, y, yaw)`` could drive in a straight line
    at each of ``bearings`` (rad from its heading, positive to the left) before its rim touches an
    obstacle or wall, to within ``step``: ``(len(bearings),)`` metres (``max_range`` where nothing
    is within that; 0 where it touches already). People are not obstacles here."""
    pose = np.asarray(pose, dtype=np.float64)
    ang = pose[2] + np.asarray(bearings, dtype=np.float64)
    t = np.arange(0.0, max_range + step, step)
    pts = pose[:2] + t[None, :, None] * np.stack([np.cos(ang), np.sin(ang)], axis=-1)[:, None, :]  # (R, T, 2)
    blocked = clearance(pts, obstacles, room_half) < radius
    first = np.where(blocked.any(axis=1), blocked.argmax(axis=1), -1)
    return np.where(first >= 0, t[np.maximum(first, 0)], max_range).astype(np.float64)


def bearing(pose: np.ndarray, point: np.ndarray) -> float:
    """Bearing (rad) of a world ``point`` from the heading of ``pose = (x, y, yaw)``: 0 ahead,
    positive to the left, ±pi behind."""
    rel = to_robot_frame(pose, point)
    return float(np.arctan2(rel[1], rel[0]))


def integrate_unicycle(pose, v, omega, dt: float, substeps: int = 1):
    """Exact unicycle integration of a constant twist over ``dt`` (vectorised over inputs)."""
    x, y, th = (np.asarray(p, dtype=np.float64) for p in pose)
    v = np.asarray(v, dtype=np.float64)
    omega = np.asarray(omega, dtype=np.float64)
    h = dt / substeps
    for _ in range(substeps):
        dth = omega * h
        small = np.abs(dth) < 1e-6
        safe = np.where(small, 1.0, omega)
        nx = np.where(small, x + v * h * np.cos(th + 0.5 * dth), x + v / safe * (np.sin(th + dth) - np.sin(th)))
        ny = np.where(small, y + v * h * np.sin(th + 0.5 * dth), y - v / safe * (np.cos(th + dth) - np.cos(th)))
        x, y, th = nx, ny, th + dth
    return x, y, wrap_angle(th)
