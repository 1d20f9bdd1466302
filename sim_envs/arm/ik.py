"""Damped-least-squares inverse kinematics for the SO-101-like arm (``mujoco.mj_jacSite``).

The solver owns a private arm-only MjModel/MjData built from the same MJCF builder as the envs,
so it can be used by an oracle without any reference to an env.

Task: the tool centre point (``tcp`` site) reaches a 3-D position; optionally the gripper axis
points straight down (2 orientation rows, the roll about the gripper axis is left free). The
tcp lies on the wrist-roll axis, so the roll joint is not used by the position/pointing task and
is set separately (``gripper_yaw`` / ``roll_for_yaw``).
"""

from __future__ import annotations

import mujoco
import numpy as np

from sim_envs.arm import so101



def wrap_angle(a: float) -> float:
    return float((a + np.pi) % (2 * np.pi) - np.pi)


class ArmIK:
    """Kinematics of the arm: forward kinematics, Jacobians and DLS IK."""

    def __init__(self) -> None:
        self.model = mujoco.MjModel.from_xml_string(so101.scene_xml("arm", with_cameras=False))
        self.data = mujoco.MjData(self.model)
        self.site = self.model.site("tcp").id
        self.qadr = np.array([self.model.joint(j).qposadr[0] for j in so101.ARM_JOINTS])
        self.dadr = np.array([self.model.joint(j).dofadr[0] for j in so101.ARM_JOINTS])
        self.low = so101.JOINT_LOW[:5].copy()
        self.high = so101.JOINT_HIGH[:5].copy()
        self._jacp = np.zeros((3, self.model.nv))
        self._jacr = np.zeros((3, self.model.nv))

    # -- forward kinematics -------------------------------------------------------------------
    def _set(self, q: np.ndarray) -> None:
        self.data.qpos[self.qadr] = q[:5]
        mujoco.mj_kinematics(self.model, self.data)

    def fk(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tcp position (3,), tcp rotation matrix (3, 3)) for arm joints ``q`` (5 or 6 values)."""
        self._set(np.asarray(q, dtype=float))
        return self.data.site_xpos[self.site].copy(), self.data.site_xmat[self.site].reshape(3, 3).copy()

    def _jacobians(self) -> tuple[np.ndarray, np.ndarray]:
        """(positional, rotational) ``(3, 4)`` Jacobians of the tcp over the first four joints, at the
        configuration :meth:`_set` last put the model in."""
        mujoco.mj_comPos(self.model, self.data)
        mujoco.mj_jacSite(self.model, self.data, self._jacp, self._jacr, self.site)
        cols = self.dadr[:4]
        return self._jacp[:, cols], self._jacr[:, cols]

    def position_jacobian(self, q: np.ndarray) -> np.ndarray:
        """``(3, 4)``: d(tcp position) / d(shoulder_pan, shoulder_lift, elbow_flex, wrist_flex) at
        arm joints ``q`` (5 or 6 values; the roll does not move the tcp)."""
        self._set(np.asarray(q, dtype=float))
        return self._jacobians()[0].copy()

    def joint_shift(self, q: np.ndarray, delta: np.ndarray, damping: float = 0.01) -> np.ndarray:
        """``(4,)``: the smallest change of the first four joints that moves the tcp by ``delta``
        (metres, world frame) to first order, at arm joints ``q`` (damped least squares)."""
        j = self.position_jacobian(q)
        return j.T @ np.linalg.solve(j @ j.T + damping**2 * np.eye(3), np.asarray(delta, dtype=float))

    def gripper_yaw(self, q: np.ndarray) -> float:
        """World yaw of the jaw closing direction (gripper frame y axis projected on the table)."""
        _, rot = self.fk(q)
        return float(np.arctan2(rot[1, 1], rot[0, 1]))

    def roll_for_yaw(self, q: np.ndarray, yaw: float, symmetry: float = np.pi) -> float:
        """Wrist-roll angle that puts the jaw closing direction at ``yaw`` (modulo ``symmetry``),
        choosing the solution nearest to the current roll and inside the joint range.

        Valid when the gripper points (nearly) down: then roll changes the yaw one-for-one, with
        the sign measured numerically here.
        """
        q = np.array(q[:5], dtype=float)
        cur = self.gripper_yaw(q)
        q2 = q.copy()
        q2[4] += 0.1
        sign = np.sign(wrap_angle(self.gripper_yaw(q2) - cur)) or 1.0
        diff = wrap_angle(yaw - cur)
        # reduce modulo the symmetry to the smallest rotation
        diff = (diff + symmetry / 2) % symmetry - symmetry / 2
        best = None
        for k in range(-4, 5):
            r = q[4] + sign * (diff + k * symmetry)
            if self.low[4] <= r <= self.high[4] and (best is None or abs(r - q[4]) < abs(best - q[4])):
                best = r
        return float(q[4] if best is None else best)

    # -- inverse kinematics -------------------------------------------------------------------
    def analytic(self, target: np.ndarray, roll: float = 0.0) -> tuple[np.ndarray, bool]:
        """Closed-form elbow-up solution with the gripper pointing down: (q (5,), reachable).

        The arm is planar after the pan rotation (no lateral offsets), so the wrist point lies
        WRIST_TO_TCP above the target and a 2-link solution places it. Unreachable targets are
        projected onto the reachable shell (and flagged); joint limits are clipped.
        """
        x, y, z = (float(v) for v in target)
        pan = float(np.arctan2(y, x))
        wu = float(np.hypot(x, y))
        wv = z + so101.WRIST_TO_TCP - so101.SHOULDER_Z
        l1, l2 = so101.UPPER_ARM, so101.FOREARM
        dist = float(np.hypot(wu, wv))
        ok = True
        lo, hi = abs(l1 - l2) + 1e-4, l1 + l2 - 1e-4
        if not lo <= dist <= hi:
            ok = False
            scale = np.clip(dist, lo, hi) / max(dist, 1e-9)
            wu, wv, dist = wu * scale, wv * scale, float(np.clip(dist, lo, hi))
        c = (dist**2 - l1**2 - l2**2) / (2 * l1 * l2)
        beta = -float(np.arccos(np.clip(c, -1.0, 1.0)))  # elbow above the shoulder-wrist line
        a1 = float(np.arctan2(wv, wu) - np.arctan2(l2 * np.sin(beta), l1 + l2 * np.cos(beta)))
        t1 = np.pi / 2 - a1
        phi = -(a1 + beta)
        q = np.array([pan, t1, phi - t1, -phi, roll])
        clipped = np.clip(q, self.low, self.high)
        ok = ok and bool(np.allclose(clipped, q))
        return clipped, ok

    def solve(
        self,
        target: np.ndarray,
        q_init: np.ndarray,
        point_down: bool = True,
        iters: int = 60,
        tol: float = 2e-4,
        damping: float = 0.02,
        orient_weight: float = 0.3,
        max_step: float = 0.3,
    ) -> tuple[np.ndarray, float]:
        """Joint angles (5,) putting the tcp at ``target``; returns (q, position error in m).

        Only shoulder_pan, shoulder_lift, elbow_flex and wrist_flex move; the roll keeps its
        value from ``q_init``. Joint limits are enforced by clipping after every update.
        """
        target = np.asarray(target, dtype=float)
        q = np.clip(np.array(q_init[:5], dtype=float), self.low, self.high)
        d = self.data
        reg = (damping**2) * np.eye(4)
        w2 = orient_weight**2
        err_norm = np.inf
        for _ in range(iters):
            self._set(q)
            pos = d.site_xpos[self.site]
            e_pos = target - pos
            err_norm = float(np.sqrt(e_pos @ e_pos))
            if point_down:
                ax = d.site_xmat[self.site].reshape(3, 3)[:, 0]  # gripper pointing direction
                # e_rot = axis × down, written out (np.cross is slow for 3-vectors)
                e_rot = np.array([-ax[1], ax[0], 0.0])
                rot_err = float(np.sqrt(e_rot @ e_rot))
            else:
                rot_err = 0.0
            if err_norm < tol and rot_err < 1e-3:
                break
            jp, jr = self._jacobians()
            # damped least squares in normal-equation form: (JᵀJ + λ²I) dq = Jᵀe
            lhs = jp.T @ jp + reg
            rhs = jp.T @ e_pos
            if point_down:
                jr = jr - np.outer(ax, ax @ jr)  # roll about the gripper axis is free
                lhs += w2 * (jr.T @ jr)
                rhs += w2 * (jr.T @ e_rot)
            dq = np.linalg.solve(lhs, rhs)
            n = np.abs(dq).max()
            if n > max_step:
                dq *= max_step / n
            q[:4] = np.clip(q[:4] + dq, self.low[:4], self.high[:4])
        else:
            self._set(q)
            e_pos = target - d.site_xpos[self.site]
            err_norm = float(np.sqrt(e_pos @ e_pos))
        return q, err_norm
