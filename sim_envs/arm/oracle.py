"""Scripted oracle for the arm tasks: a small state machine over Cartesian waypoints + IK.

It acts only from ``(obs, info)``: joint angles from ``observation.state``; the tool-centre
point, cube poses, targets and the goal indices from ``info``. Kinematics come from a private
:class:`~sim_envs.arm.ik.ArmIK` (its own MjModel built from the same MJCF builder).

A commanded Cartesian point moves toward the current phase's waypoint at a bounded speed; the
joint-position label is the IK solution for that point (gripper pointing down, wrist roll set
to align the jaws with the cube). In ``ee_delta`` mode the label is the matching
(dx, dy, dz, gripper) action instead (the wrist roll then stays where the env holds it).

Phases — pick-and-place: approach (above the cube, jaws aligned, opened just enough), descend,
close, lift (no cube in hand → approach again), move (above the bowl), lower, release, retreat
(cube not in the bowl → approach again). Push: rise, over (above a point behind the cube on
the cube→zone line), down, push along the line (re-aligning via rise/over/down when the cube
drifts off it), hold. Reach: straight to the marker.

DART noise (base class): in joint mode the standard deviation is ``noise × JOINT_NOISE_SCALE``
radians per joint (0.025 rad at noise 0.1, a few millimetres at the tool), not a share of the
joint range: half of a ±100° range would give centimetres of jitter, more than a 2.5 cm cube
tolerates. Measured success rates: ``python bench/oracles.py --noise 0.1``.

Relabelling another policy's states (``replan = True``, DAgger): the commanded point and the
phase belong to the oracle's own path, which the arm leaves as soon as something else drives it
(under the 75-demo PickPlace policy the commanded point sits a median 3-5 cm from the tool, up to
13 cm; under the oracle itself at most 1.7 cm). Each label then first re-anchors the plan to the
arm: a commanded point more than ``REANCHOR`` from the tool restarts at the tool (so the label is
one bounded step from where the arm is, as in a demonstration), and a phase the scene contradicts
is replaced: a held cube is carried (lift / move) with the jaws closed, never re-approached or
released away from the bowl; a lost cube is approached again; jaws are not closed away from the
cube.

Call ``reset(obs, info)`` at the start of every episode.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import numpy as np

from sim_envs.arm import so101
from sim_envs.arm.ik import ArmIK
from sim_envs.core import Oracle, OracleStep

OPEN = float(so101.JOINT_HIGH[5])
CLOSED = 0.0
HOVER_Z = 0.07
GRASP_Z = so101.CUBE_HALF + 0.001
PLACE_Z = 0.045
PUSH_Z = 0.016
PUSH_OFFSET = so101.PAD_INNER_GAP + 2 * so101.PAD_HALF[1]  # tcp to the outer face of a closed pad
V_MOVE = 0.012  # m per control step
V_SLOW = 0.008


def cube_yaw(quat: np.ndarray) -> float:
    w, x, y, z = quat
    return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))


REANCHOR = 0.025  # m between the commanded point and the tool beyond which ``replan`` restarts it
JOINT_NOISE_SCALE = 0.25  # rad of executed-action noise per unit of ``noise`` (joint mode)


class ArmOracle(Oracle):
    """Oracle for ``reach`` / ``push`` / ``pickplace`` (see the module docstring)."""

    def __init__(self, action_space, task: str, action_mode: str = "joint", ee_step: float = 0.015,
                 noise: float = 0.0, seed: int | None = None) -> None:
        scale = JOINT_NOISE_SCALE if action_mode == "joint" else None
        super().__init__(action_space, noise=noise, seed=seed, noise_scale=scale)
        if task not in ("reach", "push", "pickplace"):
            raise ValueError(f"unknown arm task {task!r}")
        self.task = task
        self.action_mode = action_mode
        self.ee_step = float(ee_step)
        self.ik = ArmIK()
        self.phase = "start"

    # -- episode state --------------------------------------------------------------------------
    def reset(self, obs: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        state = np.asarray(obs["observation.state"], dtype=float)
        self.cmd = np.asarray(info["ee_pos"], dtype=float).copy()
        self.roll = float(state[4])
        self.grip = OPEN if self.task != "push" else CLOSED
        self.phase = "approach" if self.task != "push" else "rise"
        self.phase_steps = 0
        self.speed = V_MOVE
        self.attempts = 0
        self.ref = np.zeros(3)
        self.state = state

    _DYNAMIC = ("phase", "phase_steps", "cmd", "roll", "grip", "speed", "attempts", "ref", "state")

    def get_state(self) -> dict:
        """A copy of the plan's episode state (phase, commanded point, jaws, ...); :meth:`set_state`
        puts it back (counterfactual rollouts, :meth:`ArmEnv.oracle_chunk`)."""
        return {k: copy.deepcopy(getattr(self, k)) for k in self._DYNAMIC if hasattr(self, k)}

    def set_state(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, copy.deepcopy(v))

    def _goto(self, phase: str) -> None:
        self.phase = phase
        self.phase_steps = 0

    def _arrived(self, goal: np.ndarray, ee: np.ndarray, tol: float) -> bool:
        return bool(np.linalg.norm(self.cmd - goal) < 1e-6 and np.linalg.norm(ee - goal) < tol)

    # -- task plans: return the Cartesian waypoint for this step -------------------------------
    def _plan_reach(self, info, ee) -> np.ndarray:
        return np.asarray(info["target_pos"][int(info["goal_target"])], dtype=float)

    def _align_roll(self, xyz: np.ndarray, yaw: float, symmetry: float = np.pi) -> None:
        q, _ = self.ik.analytic(xyz, roll=self.roll)
        self.roll = self.ik.roll_for_yaw(q, yaw, symmetry=symmetry)

    @staticmethod
    def _grasp_yaw(info, k: int) -> float:
        """Jaw closing direction for cube ``k``: one of the cube's two face normals, the one whose
        open fingers keep the most clearance from the other cubes and the bowl walls."""
        cubes = np.asarray(info["cube_pos"], dtype=float)[:, :2]
        bowls = np.asarray(info["target_pos"], dtype=float)[:, :2]
        c = cubes[k]
        reach = so101.PAD_INNER_GAP + so101.FINGER_TRAVEL + so101.PAD_HALF[1]
        best, best_clear = 0.0, -np.inf
        for yaw in (cube_yaw(info["cube_quat"][k]), cube_yaw(info["cube_quat"][k]) + np.pi / 2):
            d = np.array([np.cos(yaw), np.sin(yaw)])
            clear = np.inf
            for f in (c + reach * d, c - reach * d):
                for j, o in enumerate(cubes):
                    if j != k:
                        clear = min(clear, np.linalg.norm(f - o) - 1.5 * so101.CUBE_HALF)
                for b in bowls:
                    clear = min(clear, abs(np.linalg.norm(f - b) - so101.BOWL_RADIUS - 0.004) - 0.006)
            if clear > best_clear:
                best, best_clear = yaw, clear
        return best

    @staticmethod
    def _held(cube: np.ndarray, ee: np.ndarray) -> bool:
        return bool(np.linalg.norm(cube - ee) < 0.025 and cube[2] > so101.CUBE_HALF + 0.01)

    def _reanchor(self, info, ee: np.ndarray) -> None:
        """``replan``: move the commanded point back to the tool when the arm left the oracle's path,
        and replace a phase the scene contradicts (see the module docstring)."""
        if np.linalg.norm(self.cmd - ee) > REANCHOR:
            self.cmd = ee.copy()
        if self.task != "pickplace":
            return
        cube, bowl = self._cube_and_bowl(info)
        ph = self.phase
        if self._held(cube, ee):
            over_bowl = np.linalg.norm(ee[:2] - bowl[:2]) < so101.BOWL_RADIUS - 0.012
            if ph in ("approach", "descend") or (ph in ("release", "retreat") and not over_bowl):
                self._goto("lift" if ph in ("approach", "descend") else "move")
                self.grip = CLOSED
        elif ph in ("move", "lower"):
            self._goto("approach")
        elif ph in ("descend", "close") and np.linalg.norm(ee[:2] - cube[:2]) > 0.02:
            self._goto("approach")

    @staticmethod
    def _cube_and_bowl(info) -> tuple[np.ndarray, np.ndarray]:
        """Positions of the named cube and the named bowl."""
        return (np.asarray(info["cube_pos"][int(info["goal_cube"])], dtype=float),
                np.asarray(info["target_pos"][int(info["goal_target"])], dtype=float))

    def _plan_pick(self, info, ee) -> np.ndarray:
        k = int(info["goal_cube"])
        cube, bowl = self._cube_and_bowl(info)
        held = self._held(cube, ee)
        ph = self.phase
        if ph == "approach":
            self.speed = V_MOVE
            goal = np.array([cube[0], cube[1], HOVER_Z])
            if self.phase_steps == 0:
                self._align_roll(goal, self._grasp_yaw(info, k))
            # open just enough for the cube's width across the jaws (+8 mm a side): the
            # fingers then stay clear of nearby cubes and bowl walls
            if self.action_mode == "joint":
                closing_yaw = self.ik.gripper_yaw(np.array([*self.state[:4], self.roll]))
            else:  # the wrist roll is not controllable: use the gripper's current yaw
                closing_yaw = self.ik.gripper_yaw(self.state[:5])
            rel = cube_yaw(info["cube_quat"][k]) - closing_yaw
            extent = so101.CUBE_HALF * (abs(np.cos(rel)) + abs(np.sin(rel)))
            self.grip = min(OPEN, (extent + 0.008 - so101.PAD_INNER_GAP) / so101.GRIP_M_PER_RAD)
            if self._arrived(goal, ee, 0.015) or self.phase_steps > 40:
                self._goto("descend")
                self.ref = cube.copy()
            return goal
        if ph == "descend":
            self.speed = V_SLOW
            goal = np.array([cube[0], cube[1], max(GRASP_Z, cube[2])])
            if np.linalg.norm(cube[:2] - self.ref[:2]) > 0.015:  # cube was knocked: start again
                self._goto("approach")
            elif (np.linalg.norm(self.cmd - goal) < 1e-6 and abs(ee[2] - goal[2]) < 0.006) or self.phase_steps > 30:
                self._goto("close")
            return goal
        if ph == "close":
            self.grip = CLOSED
            if self.phase_steps >= 6:
                self._goto("lift")
            return self.cmd.copy()
        if ph == "lift":
            self.speed = V_MOVE
            goal = np.array([self.cmd[0], self.cmd[1], HOVER_Z])
            if self._arrived(goal, ee, 0.01) or self.phase_steps > 25:
                self.attempts += 1
                self._goto("move" if held else "approach")
            return goal
        if ph == "move":
            goal = np.array([bowl[0], bowl[1], HOVER_Z])
            if not held:
                self._goto("approach")
            elif self._arrived(goal, ee, 0.008) or self.phase_steps > 40:
                self._goto("lower")
            return goal
        if ph == "lower":
            self.speed = V_SLOW
            goal = np.array([bowl[0], bowl[1], PLACE_Z])
            if self._arrived(goal, ee, 0.006) or self.phase_steps > 20:
                self._goto("release")
            return goal
        if ph == "release":
            self.grip = OPEN
            if self.phase_steps >= 5:
                self._goto("retreat")
            return self.cmd.copy()
        # retreat / done: go up; if the cube is not in the bowl, try again
        self.speed = V_MOVE
        goal = np.array([self.cmd[0], self.cmd[1], HOVER_Z])
        in_bowl = np.linalg.norm(cube[:2] - bowl[:2]) < so101.BOWL_RADIUS - 0.012
        if self.phase_steps > 12 and not in_bowl and cube[2] < so101.CUBE_HALF + 0.005:
            self._goto("approach")
        return goal

    def _plan_push(self, info, ee) -> np.ndarray:
        cube = np.asarray(info["cube_pos"][0], dtype=float)
        zone = np.asarray(info["target_pos"][0], dtype=float)
        to_zone = zone[:2] - cube[:2]
        dist = float(np.linalg.norm(to_zone))
        u = to_zone / max(dist, 1e-9)
        # contact distance from the cube centre along u, for the cube's current yaw
        rel = cube_yaw(info["cube_quat"][0]) - np.arctan2(u[1], u[0])
        extent = so101.CUBE_HALF / max(abs(np.cos(rel)), abs(np.sin(rel)))
        behind = cube[:2] - u * (extent + PUSH_OFFSET + 0.002)
        pre = cube[:2] - u * (extent + PUSH_OFFSET + 0.025)
        rel_ee = self.cmd[:2] - cube[:2]  # the commanded (noise-free) pusher position
        lateral = abs(rel_ee[0] * u[1] - rel_ee[1] * u[0])
        along = float(rel_ee @ u)
        self.grip = CLOSED
        ph = self.phase
        if ph == "rise":
            self.speed = V_MOVE
            goal = np.array([ee[0], ee[1], 0.05]) if self.phase_steps == 0 else np.array([self.cmd[0], self.cmd[1], 0.05])
            if self._arrived(goal, ee, 0.01) or self.phase_steps > 15:
                self._goto("over")
            return goal
        if ph == "over":
            self.speed = V_MOVE
            goal = np.array([pre[0], pre[1], 0.05])
            if self.phase_steps == 0 or self.phase_steps % 5 == 0:
                self._align_roll(goal, float(np.arctan2(u[1], u[0])))
            if self._arrived(goal, ee, 0.008) or self.phase_steps > 40:
                self._goto("down")
            return goal
        if ph == "down":
            self.speed = V_SLOW
            goal = np.array([pre[0], pre[1], PUSH_Z])
            if self._arrived(goal, ee, 0.006) or self.phase_steps > 20:
                self._goto("push")
            return goal
        if ph == "push":
            self.speed = V_SLOW
            if dist < 0.008:
                self._goto("hold")
                return self.cmd.copy()
            if lateral > 0.01 or along > -(extent + PUSH_OFFSET - 0.006):
                self._goto("rise")
                return self.cmd.copy()
            step = min(V_SLOW, dist)
            goal = np.array([behind[0] + u[0] * step, behind[1] + u[1] * step, PUSH_Z])
            return goal
        # hold: stay; if the cube drifted out, push again
        if dist > 0.02:
            self._goto("rise")
        return self.cmd.copy()

    # -- oracle API -----------------------------------------------------------------------------
    def label(self, obs: Mapping[str, Any], info: Mapping[str, Any]) -> OracleStep:
        if self.phase == "start":
            self.reset(obs, info)
        ee = np.asarray(info["ee_pos"], dtype=float)
        self.state = np.asarray(obs["observation.state"], dtype=float)
        if self.replan:
            self._reanchor(info, ee)
        if self.task == "reach":
            goal = self._plan_reach(info, ee)
        elif self.task == "push":
            goal = self._plan_push(info, ee)
        else:
            goal = self._plan_pick(info, ee)
        self.phase_steps += 1
        delta = goal - self.cmd
        n = float(np.linalg.norm(delta))
        if n > self.speed:
            delta *= self.speed / n
        self.cmd = self.cmd + delta
        if self.action_mode == "joint":
            q, _ = self.ik.analytic(self.cmd, roll=self.roll)
            action = np.concatenate([q, [self.grip]])
        else:
            d = np.clip((self.cmd - ee) / self.ee_step, -1.0, 1.0)
            action = np.concatenate([d, [self.grip / OPEN]])
        action = np.clip(action, self.action_space.low, self.action_space.high).astype(self.action_space.dtype)
        return OracleStep(action=action, label=action.copy())
