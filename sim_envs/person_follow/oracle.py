"""Scripted follower: a short-horizon sampling planner over constant twists.

From the privileged ``info`` only (robot pose, people poses and current velocities, target
index, obstacle layout) it scores a grid of constant twists rolled out for ``horizon`` steps
against people predicted at constant velocity:

* distance band: stay ~``desired_distance`` (1.5-2.5 m) from the target;
* bearing: keep the target near the image centre;
* clearance: hard penalty for predicted contact with people (< 0.5 m + margin), obstacles and
  walls, soft penalty when closer than a comfort margin;
* line of sight: penalty when another person or a tall obstacle cuts the robot-target line;
* smoothness w.r.t. the last executed twist.

The best twist is re-planned every step (receding horizon). Its first K poses, in the robot
frame, are the waypoint label; the label twist is what pure pursuit makes of those waypoints.
"""

from __future__ import annotations

import numpy as np

from sim_envs.core import Oracle, OracleStep
from sim_envs.person_follow.geometry import obstacle_distance, segment_point_distance, wrap_angle
from sim_envs.person_follow.scene import CAMERA_HEIGHT, ROBOT_RADIUS
from sim_envs.person_follow.waypoints import arc_waypoints, pure_pursuit


class PersonFollowOracle(Oracle):
    def __init__(
        self,
        action_space,
        noise: float = 0.0,
        seed: int | None = None,
        dt: float = 0.1,
        horizon: int = 15,
        num_waypoints: int = 8,
        desired_distance: float = 2.0,
    ):
        super().__init__(action_space, noise=noise, seed=seed)
        self.dt, self.horizon, self.num_waypoints = float(dt), int(horizon), int(num_waypoints)
        self.desired_distance = float(desired_distance)
        v_max, w_max = float(action_space.high[0]), float(action_space.high[1])
        self.v_max, self.w_max = v_max, w_max
        vs = np.concatenate([np.linspace(-0.5, 0.0, 3)[:-1], np.linspace(0.0, v_max, 9)])
        ws = np.linspace(-w_max, w_max, 13)
        V, W = np.meshgrid(vs, ws, indexing="ij")
        self._v = V.ravel()
        self._w = W.ravel()
        t = self.dt * np.arange(1, self.horizon + 1)
        self._t = t
        # Robot-frame rollouts of every candidate: (C, H)
        th = self._w[:, None] * t[None, :]
        small = np.abs(self._w) < 1e-9
        ws_safe = np.where(small, 1.0, self._w)[:, None]
        self._rx = np.where(small[:, None], self._v[:, None] * t, self._v[:, None] / ws_safe * np.sin(th))
        self._ry = np.where(small[:, None], 0.0, self._v[:, None] / ws_safe * (1.0 - np.cos(th)))
        self._rth = th
        # near-term safety matters most; tracking is judged over the whole horizon
        self._w_safe = np.linspace(1.0, 0.4, self.horizon)
        self._prev = np.zeros(2)

    def reset(self, obs, info):
        self._prev = np.zeros(2)

    def label(self, obs, info) -> OracleStep:
        pose = np.asarray(info["robot_pose"], dtype=np.float64)
        people = np.asarray(info["people_poses"], dtype=np.float64)
        vel = np.asarray(info["people_velocities"], dtype=np.float64)
        mask = np.asarray(info["people_mask"], dtype=bool)
        ti = int(info["target_index"])
        obstacles = np.asarray(info["obstacles"], dtype=np.float64)[np.asarray(info["obstacle_mask"], dtype=bool)]
        room = float(info["room_half_extent"])
        prev = np.asarray(obs["observation.state"], dtype=np.float64) if "observation.state" in obs else self._prev

        x0, y0, th0 = pose
        c, s = np.cos(th0), np.sin(th0)
        # candidate world poses (C, H)
        X = x0 + c * self._rx - s * self._ry
        Y = y0 + s * self._rx + c * self._ry
        TH = th0 + self._rth
        t = self._t
        # people predicted at constant velocity (capped at 1 s: people stop and turn)
        tp = np.minimum(t, 1.0)
        P = people[:, None, :2] + vel[:, None, :] * tp[None, :, None]  # (N, H, 2)
        tgt = P[ti]  # (H, 2)
        others = [j for j in range(len(mask)) if mask[j] and j != ti]

        dx = tgt[None, :, 0] - X
        dy = tgt[None, :, 1] - Y
        dist = np.hypot(dx, dy)
        bearing = wrap_angle(np.arctan2(dy, dx) - TH)
        dd = self.desired_distance
        c_dist = np.where(dist > dd, (dist - dd) ** 2, 2.0 * (dd - dist) ** 2)
        c_dist += 20.0 * np.maximum(0.0, 1.2 - dist) ** 2
        c_bear = bearing ** 2 + 4.0 * np.maximum(0.0, np.abs(bearing) - 0.6) ** 2

        pts = np.stack([X, Y], axis=-1)  # (C, H, 2)
        walls = room - np.max(np.abs(pts), axis=-1)
        clear = walls
        if len(obstacles):
            # only obstacles the rollouts can come near, and tall ones near the line of sight
            bound = np.hypot(obstacles[:, 3], obstacles[:, 4])
            reach = self.v_max * t[-1] + ROBOT_RADIUS + 0.6
            d_robot = np.hypot(obstacles[:, 0] - x0, obstacles[:, 1] - y0) - bound
            d_los = segment_point_distance(pose[:2], tgt[-1], obstacles[:, :2]) - bound
            los_obstacles = obstacles[d_los < reach]
            obstacles = obstacles[d_robot < reach]
        else:
            los_obstacles = obstacles
        if len(obstacles):
            od = obstacle_distance(pts, obstacles).min(axis=-1)
            clear = np.minimum(clear, od)
        clear = clear - ROBOT_RADIUS
        c_safe = np.where(clear < 0.03, 1e4, 0.0) + 30.0 * np.maximum(0.0, 0.35 - clear) ** 2
        # people (target included) must stay beyond 0.5 m: keep a margin
        all_idx = [j for j in range(len(mask)) if mask[j]]
        if all_idx:
            pd = np.hypot(P[all_idx, None, :, 0] - X[None], P[all_idx, None, :, 1] - Y[None]).min(axis=0)
            c_safe += np.where(pd < 0.62, 1e4, 0.0) + 40.0 * np.maximum(0.0, 1.1 - pd) ** 2
        # line of sight: other people and tall obstacles between the robot and the target
        c_los = np.zeros_like(dist)
        if others:
            seg = segment_point_distance(pts[None], tgt[None, None], P[others][:, None, :, :])  # (No, C, H)
            c_los += np.maximum(0.0, 0.45 - seg).sum(axis=0) * 4.0
        if len(los_obstacles):
            tall = los_obstacles[los_obstacles[:, 6] >= CAMERA_HEIGHT - 0.1] if los_obstacles.shape[1] > 6 else los_obstacles
            if len(tall):
                for f in (0.33, 0.67):
                    mid = pts + f * (tgt[None] - pts)
                    c_los += 4.0 * np.maximum(0.0, 0.1 - obstacle_distance(mid, tall).min(axis=-1))

        cost = (
            (self._w_safe * c_safe).sum(axis=1)
            + 1.0 * c_dist.sum(axis=1)
            + 1.5 * c_bear.sum(axis=1)
            + 1.0 * c_los.sum(axis=1)
        )
        cost += 2.0 * (self._v - prev[0]) ** 2 + 0.3 * (self._w - prev[1]) ** 2
        cost += 3.0 * np.maximum(0.0, -self._v)
        best = int(np.argmin(cost))
        v, w = float(self._v[best]), float(self._w[best])
        wps = arc_waypoints(v, w, self.dt, self.num_waypoints)
        pv, pw = pure_pursuit(wps, self.v_max, self.w_max, self.dt)
        label = np.clip(np.array([pv, pw], dtype=np.float32), self.action_space.low, self.action_space.high)
        self._prev = label.astype(np.float64)
        return OracleStep(action=label.copy(), label=label, extras={"waypoints": wps})
