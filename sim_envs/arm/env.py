"""SO-101-like desktop arm tasks: reach, push a cube, language-conditioned pick-and-place.

Observation (gymnasium Dict, LeRobot keys):
  ``observation.images.front`` / ``observation.images.wrist``  uint8 (H, W, 3)  (absent when
  ``use_cameras=False``), ``observation.state`` float32 (6,): the five arm joint angles (rad)
  and the gripper angle (rad, 0 closed .. 1.745 open), ``task``: the language instruction.

Actions (20 Hz): ``action_mode="joint"`` (default) → absolute joint-position targets, Box (6,)
within the joint limits; ``action_mode="ee_delta"`` → (dx, dy, dz, gripper) with dx..dz in
[-1, 1] scaled by ``ee_step`` metres from the current tool-centre point, resolved by
damped-least-squares IK with the gripper kept pointing down (wrist roll held at its reset
value), and gripper in [0, 1] (0 closed, 1 fully open).

With ``env_state=True`` the observation also holds ``observation.environment_state`` float32
(:attr:`ArmEnv.env_state_dim`,): the privileged scene state as low-dimensional values (LeRobot's
key for it; see :meth:`ArmEnv.environment_state`), for state-based policies and refinement.

Privileged state (for oracles, metrics, relabelling) is in ``info``: ``ee_pos``,
``target_pos``, ``goal_target``, ``target_colors`` and, with cubes, ``cube_pos``,
``cube_quat``, ``goal_cube``, ``cube_colors``; ``goal_pos`` (6,): the named cube's xyz (the
tool-centre point without cubes) and the named target's; ``goal_rel`` (6,): those two minus
the tool-centre point; ``goal_grip`` (6,): the first minus the tool-centre point, the second as
it is; also ``task`` and ``is_success``, and
``episode_metrics`` (success, steps, return, steps_to_success, final_distance) on the last step.
PickPlace adds ``wrong_object`` to both: a cube other than the named one was lifted (its centre
more than ``WRONG_OBJECT_LIFT`` = 2 cm above its resting height) at some step of the episode.
Episodes terminate after the success condition held for ``SUCCESS_HOLD`` consecutive steps and
are truncated at ``max_steps`` (the env's own limit; 100 / 150 / 200 by default).

Vector envs: use ``gymnasium.vector.AsyncVectorEnv(..., shared_memory=False)`` — gymnasium's
shared-memory path reads ``Text`` observations once at construction and never updates them.
With EGL rendering, start workers with ``context="spawn"`` (or "forkserver") when the parent
process has already rendered: a forked child then hangs creating its own EGL context.
"""

from __future__ import annotations

import math
import string
from typing import Any

import gymnasium
import mujoco
import numpy as np
from gymnasium import spaces

from sim_envs.arm import so101
from sim_envs.arm.ik import ArmIK
from sim_envs.core import check_action, check_choice, check_options

TEXT_CHARSET = string.ascii_letters + string.digits + " .,'-_"
SUCCESS_HOLD = 3  # consecutive successful steps before the episode terminates
ENV_STATE = "observation.environment_state"
REACH_SHARPNESS = 10.0  # 1/m: the staged reward's reaching term, 1 - tanh(REACH_SHARPNESS * distance)
WRONG_OBJECT_LIFT = 0.02  # m: a cube whose centre rises this far above its resting height has been lifted


def _dist(a, b) -> float:
    """Euclidean distance of two short vectors (faster than np.linalg.norm for 2-3 values)."""
    return math.sqrt(sum((float(x) - float(y)) ** 2 for x, y in zip(a, b)))


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


def _check_number(name: str, value: Any, lo: float, lo_allowed: bool) -> float:
    """A finite real number above ``lo`` (or equal to it, with ``lo_allowed``); bools refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and (value >= lo if lo_allowed else value > lo)):
        raise ValueError(f"{name} must be a finite number {'>=' if lo_allowed else '>'} {lo:g}, got {value!r}")
    return float(value)


class ArmEnv(gymnasium.Env):
    """Base class of the arm tasks (not registered itself). Subclasses define the scene
    (``TASK``, cubes, targets), the layout sampling, the instruction, reward and success."""

    # Privileged label recorded with every frame (robopolicy.data.features.env_features):
    # ``info["goal_pos"]``: the named object's xyz (the tool-centre point when the task has no
    # cube) and the named target's xyz, metres in the world frame; for auxiliary losses.
    # ``info["goal_rel"]``: the same two points minus the tool-centre point (where they are from
    # the gripper, which a wrist camera sees directly). ``info["goal_grip"]``: the named object
    # from the tool-centre point and the named target in the world frame (what moves with the
    # gripper relative to it, what stays put absolute).
    label_shapes = {"label.goal_pos": (6,), "label.goal_rel": (6,), "label.goal_grip": (6,)}

    metadata = {"render_modes": ["rgb_array"], "render_fps": int(round(1.0 / so101.CONTROL_DT))}
    TASK = "arm"
    DEFAULT_MAX_STEPS = 100
    CAMERAS = ("front", "wrist")

    def __init__(
        self,
        render_mode: str | None = None,
        image_size: int = 96,
        use_cameras: bool = True,
        action_mode: str = "joint",
        max_steps: int | None = None,
        ee_step: float = 0.015,
        render_size: int = 240,
        env_state: bool = False,
    ) -> None:
        super().__init__()
        self.render_mode = check_choice("render_mode", render_mode, (None, "rgb_array"))
        self.image_size = _check_int("image_size", image_size, 16, 1024)
        self.render_size = _check_int("render_size", render_size, 16, 2048)
        self.use_cameras = check_choice("use_cameras", use_cameras, (True, False))
        self.action_mode = check_choice("action_mode", action_mode, ("joint", "ee_delta"))
        self.env_state = check_choice("env_state", env_state, (True, False))
        # (not ``max_episode_steps``: gymnasium.make() takes that one for its TimeLimit wrapper)
        if max_steps is None:
            max_steps = self.DEFAULT_MAX_STEPS
        self.max_episode_steps = _check_int("max_steps", max_steps, 1, 100_000)
        if not (isinstance(ee_step, (int, float)) and np.isfinite(ee_step) and 0 < ee_step <= 0.05):
            raise ValueError(f"ee_step must be a number in (0, 0.05] metres, got {ee_step!r}")
        self.ee_step = float(ee_step)

        self.model = mujoco.MjModel.from_xml_string(
            so101.scene_xml(self.TASK, self.num_cubes, self.num_targets, with_cameras=True)
        )
        self.data = mujoco.MjData(self.model)
        m = self.model
        self._arm_qadr = np.array([m.joint(j).qposadr[0] for j in so101.ARM_JOINTS])
        self._finger_qadr = np.array([m.joint(f"finger_{s}").qposadr[0] for s in ("left", "right")])
        self._finger_dadr = np.array([m.joint(f"finger_{s}").dofadr[0] for s in ("left", "right")])
        self._tcp = m.site("tcp").id
        self._cube_qadr = [m.joint(f"cube{i}").qposadr[0] for i in range(self.num_cubes)]
        self._cube_body = np.array([m.body(f"cube{i}").id for i in range(self.num_cubes)], dtype=int)
        self._cube_geom = [m.geom(f"cube{i}").id for i in range(self.num_cubes)]
        self._target_mocap = [m.body_mocapid[m.body(f"target{i}").id] for i in range(self.num_targets)]
        self._target_geoms = [
            np.flatnonzero(m.geom_bodyid == m.body(f"target{i}").id) for i in range(self.num_targets)
        ]
        self._cam_ids = {name: m.camera(name).id for name in ("front", "wrist", "topdown")}
        self.ik = ArmIK()
        self._home, _ = self.ik.analytic(np.array([0.14, 0.0, 0.10]))

        # spaces
        obs_spaces: dict[str, spaces.Space] = {}
        if self.use_cameras:
            for cam in self.CAMERAS:
                obs_spaces[f"observation.images.{cam}"] = spaces.Box(
                    0, 255, (self.image_size, self.image_size, 3), np.uint8
                )
        obs_spaces["observation.state"] = spaces.Box(
            so101.JOINT_LOW.astype(np.float32) - 0.5, so101.JOINT_HIGH.astype(np.float32) + 0.5, (6,), np.float32
        )
        if self.env_state:
            obs_spaces[ENV_STATE] = spaces.Box(-np.inf, np.inf, (self.env_state_dim,), np.float32)
        obs_spaces["task"] = spaces.Text(max_length=256, min_length=1, charset=TEXT_CHARSET)
        self.observation_space = spaces.Dict(obs_spaces)
        if self.action_mode == "joint":
            self.action_space = spaces.Box(
                so101.JOINT_LOW.astype(np.float32), so101.JOINT_HIGH.astype(np.float32), (6,), np.float32
            )
        else:
            self.action_space = spaces.Box(
                np.array([-1, -1, -1, 0], np.float32), np.array([1, 1, 1, 1], np.float32), (4,), np.float32
            )
        self._act_low = self.action_space.low.astype(np.float64)
        self._act_high = self.action_space.high.astype(np.float64)

        self._obs_renderer: mujoco.Renderer | None = None
        self._view_renderer: mujoco.Renderer | None = None
        self._instruction = ""
        self._steps = 0
        self._success_count = 0
        self._return = 0.0
        self._first_success = -1
        self._roll_hold = 0.0
        self._layout_qpos: np.ndarray | None = None
        self.cube_colors: tuple[str, ...] = ()
        self.target_colors: tuple[str, ...] = ()
        self.goal_cube = -1
        self.goal_target = 0

    # -- per-task hooks -----------------------------------------------------------------------
    num_cubes = 0
    num_targets = 1

    def _sample_task(self, rng: np.random.Generator) -> None:
        """Colours, goal, instruction, object and target placements (writes qpos / mocap)."""
        raise NotImplementedError

    def _evaluate(self) -> tuple[bool, float, float]:
        """(success now, reward, task distance) for the current state."""
        raise NotImplementedError

    # -- helpers ------------------------------------------------------------------------------
    def _sample_points(self, rng, n, r_range, a_range, min_sep, existing=()) -> list[np.ndarray]:
        """Rejection-sample ``n`` table points in a polar sector around the base, each at
        least ``min_sep[k]`` (per point) from the others and from ``existing`` (point, sep)."""
        placed: list[tuple[np.ndarray, float]] = list(existing)
        out = []
        for k in range(n):
            sep = min_sep[k]
            for _ in range(200):
                r = rng.uniform(*r_range)
                a = rng.uniform(*a_range)
                p = np.array([r * np.cos(a), r * np.sin(a)])
                if all(np.linalg.norm(p - q) >= max(sep, s) for q, s in placed):
                    break
            else:
                return None  # no room left: the caller samples a new layout
            placed.append((p, sep))
            out.append(p)
        return out

    def _set_cube(self, i: int, xy: np.ndarray, yaw: float) -> None:
        adr = self._cube_qadr[i]
        self.data.qpos[adr : adr + 3] = (xy[0], xy[1], so101.CUBE_HALF)
        self.data.qpos[adr + 3 : adr + 7] = (np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2))

    def _set_color(self, geoms, name: str, alpha: float = 1.0) -> None:
        self.model.geom_rgba[geoms] = (*so101.COLORS[name], alpha)

    def _finger_mean(self) -> float:
        qpos = self.data.qpos
        return 0.5 * (float(qpos[self._finger_qadr[0]]) + float(qpos[self._finger_qadr[1]]))

    def gripper_angle(self) -> float:
        return self._finger_mean() / so101.GRIP_M_PER_RAD

    def _state(self) -> np.ndarray:
        s = np.empty(6, np.float32)
        s[:5] = self.data.qpos[self._arm_qadr]
        s[5] = self.gripper_angle()
        return s

    @property
    def env_state_dim(self) -> int:
        """Size of :meth:`environment_state`: 17 + 5 per other cube + 3 per other target."""
        return 17 + 5 * max(self.num_cubes - 1, 0) + 3 * (self.num_targets - 1)

    def environment_state(self) -> np.ndarray:
        """The scene as an oracle sees it, goal objects first, metres in the world frame:

        ``[0:3]`` tool-centre point, ``[3:6]`` goal cube centre (zeros without cubes), ``[6:8]``
        its yaw as ``(cos 4θ, sin 4θ)`` (a cube looks the same every quarter turn), ``[8:11]``
        goal target, ``[11:14]`` goal cube − tcp (target − tcp without cubes), ``[14:17]`` goal
        target − goal cube (target − tcp without cubes); then each other cube (centre, yaw pair)
        and each other target (centre), in scene order.
        """
        d = self.data
        ee = d.site_xpos[self._tcp]
        targets = d.mocap_pos[self._target_mocap]
        target = targets[self.goal_target]
        parts = [ee]
        if self.num_cubes:
            cube = d.xpos[self._cube_body[self.goal_cube]]
            parts += [cube, self._yaw_pair(self.goal_cube), target, cube - ee, target - cube]
            for i in range(self.num_cubes):
                if i != self.goal_cube:
                    parts += [d.xpos[self._cube_body[i]], self._yaw_pair(i)]
        else:
            parts += [np.zeros(5), target, target - ee, target - ee]
        parts += [targets[i] for i in range(self.num_targets) if i != self.goal_target]
        return np.concatenate(parts).astype(np.float32)

    def _yaw_pair(self, i: int) -> np.ndarray:
        w, x, y, z = self.data.xquat[self._cube_body[i]]
        yaw = math.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
        return np.array([math.cos(4 * yaw), math.sin(4 * yaw)])

    def _grow_framebuffer(self, size: int) -> None:
        vis = self.model.vis.global_
        vis.offwidth = max(vis.offwidth, size)
        vis.offheight = max(vis.offheight, size)

    def _render_obs_images(self) -> dict[str, np.ndarray]:
        if self._obs_renderer is None:
            self._grow_framebuffer(self.image_size)
            self._obs_renderer = mujoco.Renderer(self.model, self.image_size, self.image_size)
        out = {}
        for cam in self.CAMERAS:
            self._obs_renderer.update_scene(self.data, camera=self._cam_ids[cam])
            out[f"observation.images.{cam}"] = self._obs_renderer.render()
        return out

    def _obs(self) -> dict[str, Any]:
        obs: dict[str, Any] = self._render_obs_images() if self.use_cameras else {}
        obs["observation.state"] = self._state()
        if self.env_state:
            obs[ENV_STATE] = self.environment_state()
        obs["task"] = self._instruction
        return obs

    def _info(self, success: bool) -> dict[str, Any]:
        d = self.data
        info: dict[str, Any] = {
            "is_success": bool(success),
            "task": self._instruction,
            "ee_pos": d.site_xpos[self._tcp].copy(),
            "target_pos": d.mocap_pos[self._target_mocap].copy(),
            "goal_target": self.goal_target,
            "target_colors": self.target_colors,
        }
        if self.num_cubes:
            info["cube_pos"] = d.xpos[self._cube_body].copy()
            info["cube_quat"] = d.xquat[self._cube_body].copy()
            info["goal_cube"] = self.goal_cube
            info["cube_colors"] = self.cube_colors
        target = info["target_pos"][self.goal_target]
        obj = info["cube_pos"][self.goal_cube] if self.num_cubes else info["ee_pos"]
        info["goal_pos"] = np.concatenate([obj, target]).astype(np.float32)
        info["goal_rel"] = np.concatenate([obj - info["ee_pos"], target - info["ee_pos"]]).astype(np.float32)
        info["goal_grip"] = np.concatenate([obj - info["ee_pos"], target]).astype(np.float32)
        return info

    def _start_joints(self, rng) -> np.ndarray:
        """The arm's joint angles at reset: home with a little noise, within the joint limits."""
        return np.clip(self._home + rng.normal(0.0, 0.03, size=5), so101.JOINT_LOW[:5], so101.JOINT_HIGH[:5])

    # -- gymnasium API ------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        check_options(options, ())
        rng = self.np_random
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        q = self._start_joints(rng)
        d.qpos[self._arm_qadr] = q
        d.qpos[self._finger_qadr] = so101.FINGER_TRAVEL
        d.ctrl[:5] = q
        d.ctrl[5:7] = so101.FINGER_TRAVEL
        self._roll_hold = float(q[4])
        self._sample_task(rng)
        mujoco.mj_forward(m, d)
        return self._start_episode()

    def continue_episode(self, goal_cube: int, goal_target: int):
        """Start a new episode in the scene as it stands (unattended collection: the arm itself
        rearranged it, :mod:`sim_envs.arm.rearrange`). Nothing is moved or sampled; the next goal
        is given (its instruction worded as the task's own reset words it), the episode counters
        restart. Returns ``(obs, info)`` as :meth:`reset` does."""
        if not (0 <= goal_target < self.num_targets and (0 <= goal_cube < self.num_cubes or not self.num_cubes)):
            raise ValueError(f"goal cube {goal_cube} / target {goal_target} out of range")
        self.goal_cube, self.goal_target = int(goal_cube), int(goal_target)
        self._instruction = self._goal_instruction()
        self._roll_hold = float(self.data.qpos[self._arm_qadr[4]])
        return self._start_episode()

    def _start_episode(self):
        """Restart the episode on the scene as it stands (after :meth:`reset` or
        :meth:`continue_episode`): the counters, and the layout :meth:`pose` starts every pose from.
        Returns the first ``(obs, info)``."""
        self._layout_qpos = self.data.qpos.copy()
        self._steps, self._success_count, self._return, self._first_success = 0, 0, 0.0, -1
        success, _, _ = self._evaluate()
        return self._obs(), self._info(success)

    def _goal_instruction(self) -> str:
        """The instruction naming the current goal (``goal_cube``, ``goal_target``)."""
        raise NotImplementedError

    def _apply_action(self, a: np.ndarray) -> None:
        d = self.data
        if self.action_mode == "joint":
            d.ctrl[:5] = a[:5]
            d.ctrl[5:7] = a[5] * so101.GRIP_M_PER_RAD
        else:
            target = d.site_xpos[self._tcp] + a[:3] * self.ee_step
            q_now = d.qpos[self._arm_qadr]
            q, _ = self.ik.solve(target, q_now, point_down=True, iters=3, tol=2e-4)
            d.ctrl[:4] = q[:4]
            d.ctrl[4] = self._roll_hold
            d.ctrl[5:7] = a[3] * so101.FINGER_TRAVEL

    def step(self, action):
        a = np.clip(check_action(action, self.action_space), self._act_low, self._act_high)
        self._apply_action(a)
        d = self.data
        # squeezing: commanded closed beyond where the fingers are, and they are not moving
        squeezing = d.ctrl[5] < self._finger_mean() - 0.001 and abs(float(d.qvel[self._finger_dadr[0]])) < 0.02
        self.model.opt.noslip_iterations = so101.NOSLIP_ITERATIONS if squeezing else 0
        mujoco.mj_step(self.model, d, nstep=so101.N_SUBSTEPS)
        self._steps += 1
        success, reward, dist = self._evaluate()
        self._return += reward
        if success:
            self._success_count += 1
            if self._first_success < 0:
                self._first_success = self._steps
        else:
            self._success_count = 0
        terminated = self._success_count >= SUCCESS_HOLD
        truncated = (not terminated) and self._steps >= self.max_episode_steps
        info = self._info(success)
        if terminated or truncated:
            info["episode_metrics"] = {
                "success": bool(success),
                "steps": self._steps,
                "return": float(self._return),
                "steps_to_success": self._first_success,
                "final_distance": float(dist),
            }
        return self._obs(), float(reward), terminated, truncated, info

    # -- posed frames (perception data) --------------------------------------------------------
    def pose(self, rng: np.random.Generator | None = None,
             phases: dict[str, float] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Put the arm (and the objects it would be handling) into a random pose of the task,
        kinematically, and return ``(obs, info)`` as :meth:`reset` does, labels included.

        For perception training data: a frame of a new pose costs a render, not an oracle
        episode, so a locator can see many more layouts and arm poses than demonstrations
        hold. Call after :meth:`reset` (which samples the layout); every pose starts from that
        layout (a cube carried in one pose is back in its place for the next), and the objects a
        pose does not handle stay put. No physics runs: the scene is not stepped and is not meant to be (call
        :meth:`reset` before stepping again). Which poses are drawn is the task's
        (:meth:`_sample_pose`; ``phases``: weights of its phases by name, over the task's
        defaults in :attr:`POSE_PHASES`); the base class draws a free tool-centre point.
        """
        if self._layout_qpos is None:
            raise RuntimeError("pose() needs a layout: call reset() first")
        rng = self.np_random if rng is None else rng
        names, p = self.pose_weights(phases)
        d = self.data
        d.qpos[:] = self._layout_qpos  # each pose starts from the layout, not from the previous pose
        q, grip = self._sample_pose(rng, names[int(rng.choice(len(names), p=p))])
        d.qpos[self._arm_qadr] = q
        d.qpos[self._finger_qadr] = grip * so101.GRIP_M_PER_RAD
        d.qvel[:] = 0.0
        mujoco.mj_forward(self.model, d)
        success, _, _ = self._evaluate()
        return self._obs(), self._info(success)

    def _free_tcp(self, rng) -> np.ndarray:
        a = rng.uniform(-1.2, 1.2)
        r = rng.uniform(0.08, 0.24)
        return np.array([r * np.cos(a), r * np.sin(a), rng.uniform(0.03, 0.16)])

    def _pose_at(self, tcp: np.ndarray, rng, yaw: float | None = None) -> np.ndarray:
        """Joint angles (5,) that put the tool-centre point at ``tcp`` pointing down, the jaws
        closing along ``yaw`` (a random wrist roll when None)."""
        q, _ = self.ik.analytic(tcp, roll=float(rng.uniform(-1.5, 1.5)))
        if yaw is not None:
            q[4] = self.ik.roll_for_yaw(q, yaw)
        return q

    POSE_PHASES = {"free": 1.0}

    @classmethod
    def pose_weights(cls, phases: dict[str, float] | None = None) -> tuple[list[str], np.ndarray]:
        """The phase names of :meth:`pose` and their probabilities: :attr:`POSE_PHASES` with
        ``phases`` over them. Unknown names or weights that are negative, not finite or all zero
        raise ``ValueError``."""
        weights = dict(cls.POSE_PHASES)
        unknown = sorted(set(phases or {}) - set(weights))
        if unknown:
            raise ValueError(f"pose phases {unknown} unknown to {cls.__name__} (it has {sorted(weights)})")
        weights.update(phases or {})
        if any(not np.isfinite(w) or w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"pose phase weights must be >= 0 with a positive sum, got {weights}")
        p = np.asarray(list(weights.values()), dtype=float)
        return list(weights), p / p.sum()

    def _sample_pose(self, rng, phase: str) -> tuple[np.ndarray, float]:
        """(arm joint angles (5,), gripper angle) of a random pose of ``phase``; may move the
        task's objects."""
        return self._pose_at(self._free_tcp(rng), rng), float(rng.uniform(0.0, so101.JOINT_HIGH[5]))

    # -- rendering ----------------------------------------------------------------------------
    def render_views(self) -> dict[str, np.ndarray]:
        """Front, wrist and top-down views at ``render_size`` (uint8 H×W×3 each)."""
        if self._view_renderer is None:
            self._grow_framebuffer(self.render_size)
            self._view_renderer = mujoco.Renderer(self.model, self.render_size, self.render_size)
        views = {}
        for name in ("front", "wrist", "topdown"):
            self._view_renderer.update_scene(self.data, camera=self._cam_ids[name])
            views[name] = self._view_renderer.render()
        return views

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        return np.concatenate(list(self.render_views().values()), axis=1)

    def close(self) -> None:
        for r in (self._obs_renderer, self._view_renderer):
            if r is not None:
                r.close()
        self._obs_renderer = self._view_renderer = None

    # -- counterfactuals -----------------------------------------------------------------------
    _COUNTERS = ("_steps", "_success_count", "_return", "_first_success", "_roll_hold")

    def get_state(self) -> dict:
        """A copy of what changes within an episode: MuJoCo's integration state (positions,
        velocities, controls, warm start, time) and the episode counters; the layout is fixed at
        reset. :meth:`set_state` puts it back, after which stepping continues exactly as before."""
        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        sim = np.empty(mujoco.mj_stateSize(self.model, spec))
        mujoco.mj_getState(self.model, self.data, sim, spec)
        return {"sim": sim, **{k: getattr(self, k) for k in self._COUNTERS}}

    def set_state(self, state: dict) -> None:
        missing = [k for k in ("sim", *self._COUNTERS) if k not in state]
        if missing:
            raise ValueError(f"set_state: the state lacks {missing}")
        mujoco.mj_setState(self.model, self.data, np.asarray(state["sim"], np.float64),
                           mujoco.mjtState.mjSTATE_INTEGRATION)
        for k in self._COUNTERS:
            setattr(self, k, state[k])
        mujoco.mj_forward(self.model, self.data)

    def oracle_chunk(self, oracle, label: np.ndarray, horizon: int) -> np.ndarray:
        """The oracle's own next ``horizon`` labels from the current state, ``label`` (its label for
        this state, already given) first: ``(n, A)``, ``n <= horizon``, shorter when the episode
        would end sooner. A counterfactual: the oracle drives without rendering, then the env and
        the oracle (``get_state`` / ``set_state``) are put back, so the episode continues as if it
        had not been asked. This is the chunk a chunk policy should predict here (DAgger)."""
        saved, saved_oracle, cameras = self.get_state(), oracle.get_state(), self.use_cameras
        labels = [np.asarray(label)]
        self.use_cameras = False
        try:
            for _ in range(int(horizon) - 1):
                obs, _, terminated, truncated, info = self.step(labels[-1])
                if terminated or truncated:
                    break
                labels.append(np.asarray(oracle.label(obs, info).label))
        finally:
            self.use_cameras = cameras
            self.set_state(saved)
            oracle.set_state(saved_oracle)
        return np.stack(labels)

    # -- oracle -------------------------------------------------------------------------------
    def make_oracle(self, noise: float = 0.0, seed: int | None = None):
        from sim_envs.arm.oracle import ArmOracle

        return ArmOracle(
            self.action_space, task=self.TASK, action_mode=self.action_mode, ee_step=self.ee_step,
            noise=noise, seed=seed,
        )


# ------------------------------------------------------------------------------------------------
class ArmReachEnv(ArmEnv):
    """Move the gripper's tool-centre point to the named floating target marker.

    Extra kwarg ``num_targets`` (1..4, default 1): markers of distinct colours; the instruction
    names the goal one. Success: tcp within 2 cm of the goal marker.
    """

    TASK = "reach"
    DEFAULT_MAX_STEPS = 100
    SUCCESS_RADIUS = 0.02

    def __init__(self, num_targets: int = 1, **kwargs) -> None:
        self.num_targets = _check_int("num_targets", num_targets, 1, 4)
        super().__init__(**kwargs)

    def _sample_task(self, rng):
        names = rng.choice(len(so101.COLOR_NAMES), size=self.num_targets, replace=False)
        self.target_colors = tuple(so101.COLOR_NAMES[i] for i in names)
        pts = None
        while pts is None:
            pts = self._sample_points(rng, self.num_targets, (0.10, 0.22), (-1.0, 1.0), [0.06] * self.num_targets)
        for i, p in enumerate(pts):
            self.data.mocap_pos[self._target_mocap[i]] = (p[0], p[1], rng.uniform(0.02, 0.10))
            self._set_color(self._target_geoms[i], self.target_colors[i], 0.85)
        self.goal_target = int(rng.integers(self.num_targets))
        self._instruction = self._goal_instruction()

    def _goal_instruction(self) -> str:
        return f"reach the {self.target_colors[self.goal_target]} target"

    def _evaluate(self):
        dist = _dist(self.data.site_xpos[self._tcp], self.data.mocap_pos[self._target_mocap[self.goal_target]])
        success = dist < self.SUCCESS_RADIUS
        return success, -dist + (1.0 if success else 0.0), dist


class ArmPushCubeEnv(ArmEnv):
    """Push the cube (on the table, no lifting needed) into the flat target zone.

    Success: cube centre within 3 cm of the zone centre (zone radius 4 cm), cube on the table.
    """

    TASK = "push"
    DEFAULT_MAX_STEPS = 150
    num_cubes = 1
    num_targets = 1
    SUCCESS_RADIUS = so101.ZONE_RADIUS - 0.01

    def _sample_task(self, rng):
        c, z = rng.choice(len(so101.COLOR_NAMES), size=2, replace=False)
        self.cube_colors = (so101.COLOR_NAMES[c],)
        self.target_colors = (so101.COLOR_NAMES[z],)
        self._set_color(self._cube_geom[0], self.cube_colors[0])
        self._set_color(self._target_geoms[0], self.target_colors[0])
        for _ in range(10_000):
            zone, cube = self._sample_points(rng, 2, (0.12, 0.22), (-0.9, 0.9), [0.0, 0.0])
            if 0.08 <= np.linalg.norm(zone - cube) <= 0.15 and 0.13 <= np.linalg.norm(cube) <= 0.21:
                break
        self.data.mocap_pos[self._target_mocap[0]] = (zone[0], zone[1], 0.0)
        self._set_cube(0, cube, rng.uniform(-np.pi / 4, np.pi / 4))
        self.goal_cube, self.goal_target = 0, 0
        self._instruction = self._goal_instruction()

    def _goal_instruction(self) -> str:
        return f"push the {self.cube_colors[self.goal_cube]} cube to the {self.target_colors[self.goal_target]} zone"

    def _evaluate(self):
        d = self.data
        cube = d.xpos[self._cube_body[0]]
        zone = d.mocap_pos[self._target_mocap[0]]
        dist = _dist(cube[:2], zone[:2])
        success = dist < self.SUCCESS_RADIUS and cube[2] < so101.CUBE_HALF + 0.005
        reward = -dist - 0.5 * _dist(d.site_xpos[self._tcp], cube) + (1.0 if success else 0.0)
        return success, reward, dist


class ArmPickPlaceEnv(ArmEnv):
    """Language-conditioned pick-and-place: "put the blue cube in the green bowl".

    Extra kwargs: ``num_cubes`` (1..4, default 3) cubes of distinct colours, ``num_bowls``
    (1..3, default 3) shallow bowls of distinct colours, ``split``: "train" (default) never
    asks for one of the held-out (cube colour, bowl colour) goal pairs in ``HELDOUT_PAIRS``,
    "test" always asks for one of them, "all" for any pair. Success (judged on the named cube
    and bowl only): the goal cube rests inside the goal bowl and the gripper has let go of it.
    ``reward``: "dense" (default) is ``-|tcp - cube| - 2 * (cube-to-bowl xy distance) + 1 on
    success``; "staged" averages three terms in [0, 1] — reaching the cube ``1 - tanh(10 |tcp -
    cube|)``, holding it (lifted at least 7.5 mm with the tool point within 2 cm of it) and placing
    it ``1 - tanh(10 * xy distance)``, counted only while the cube is held or already inside the
    bowl — then subtracts 1 (so every step before success costs, and finishing early never does)
    and adds 1 on success. Staged rewards a grasp that holds over one that only comes close.
    ``align_weight`` (default 0: off) adds to staged's terms one more, of that
    weight in the average: the tool point over the goal cube's centre, ``1 - tanh(100 * xy
    distance)`` while the cube is on the table and 1 once it is lifted (so lifting never costs).
    The 3-D reaching term is dominated by height on the descent, where the grasp's centring is
    decided; this term pays for the centring there, millimetre by millimetre.
    """

    TASK = "pickplace"
    DEFAULT_MAX_STEPS = 200
    HELDOUT_PAIRS = frozenset(
        {("red", "green"), ("green", "blue"), ("blue", "yellow"), ("yellow", "purple"),
         ("purple", "orange"), ("orange", "red")}
    )

    def __init__(self, num_cubes: int = 3, num_bowls: int = 3, split: str = "train", reward: str = "dense",
                 align_weight: float = 0.0, **kwargs) -> None:
        self.num_cubes = _check_int("num_cubes", num_cubes, 1, 4)
        self.num_targets = _check_int("num_bowls", num_bowls, 1, 3)
        self.split = check_choice("split", split, ("train", "test", "all"))
        self.reward_mode = check_choice("reward", reward, ("dense", "staged"))
        self.align_weight = _check_number("align_weight", align_weight, 0.0, lo_allowed=True)
        if self.reward_mode == "dense" and self.align_weight:
            raise ValueError("align_weight shapes the staged reward; reward='dense' has no such terms")
        super().__init__(**kwargs)

    def _sample_colors(self, rng) -> None:
        nc, nb, names = self.num_cubes, self.num_targets, so101.COLOR_NAMES
        self.goal_cube = int(rng.integers(nc))
        self.goal_target = int(rng.integers(nb))
        if self.split == "test":
            pairs = sorted(self.HELDOUT_PAIRS)
            gc, gb = pairs[int(rng.integers(len(pairs)))]
            others_c = [n for n in names if n != gc]
            others_b = [n for n in names if n != gb]
            cubes = [others_c[i] for i in rng.choice(len(others_c), size=nc - 1, replace=False)]
            bowls = [others_b[i] for i in rng.choice(len(others_b), size=nb - 1, replace=False)]
            cubes.insert(self.goal_cube, gc)
            bowls.insert(self.goal_target, gb)
            self.cube_colors, self.target_colors = tuple(cubes), tuple(bowls)
            return
        while True:
            cc = rng.choice(len(names), size=nc, replace=False)
            bc = rng.choice(len(names), size=nb, replace=False)
            self.cube_colors = tuple(names[i] for i in cc)
            self.target_colors = tuple(names[i] for i in bc)
            pair = (self.cube_colors[self.goal_cube], self.target_colors[self.goal_target])
            if self.split == "all" or pair not in self.HELDOUT_PAIRS:
                return

    def _sample_task(self, rng):
        nc, nb = self.num_cubes, self.num_targets
        self._sample_colors(rng)
        bowl_sep = 2 * (so101.BOWL_RADIUS + 0.006) + 0.005
        # cubes keep the open fingers (3.5 cm from the cube centre) clear of the bowl walls
        cube_sep = so101.BOWL_RADIUS + 0.045
        for _ in range(1000):
            bowls = self._sample_points(rng, nb, (0.13, 0.22), (-1.1, 1.1), [bowl_sep] * nb)
            if bowls is None:
                continue
            existing = [(b, cube_sep) for b in bowls]
            cubes = self._sample_points(rng, nc, (0.13, 0.22), (-1.1, 1.1), [0.05] * nc, existing)
            if cubes is not None:
                break
        else:  # pragma: no cover - the sector has room for 4 cubes and 3 bowls
            raise RuntimeError("could not place the cubes and bowls")
        for i, b in enumerate(bowls):
            self.data.mocap_pos[self._target_mocap[i]] = (b[0], b[1], 0.0)
            self._set_color(self._target_geoms[i], self.target_colors[i])
        for i, c in enumerate(cubes):
            self._set_cube(i, c, rng.uniform(-np.pi / 4, np.pi / 4))
            self._set_color(self._cube_geom[i], self.cube_colors[i])
        self._instruction = self._goal_instruction()

    def _goal_instruction(self) -> str:
        return f"put the {self.cube_colors[self.goal_cube]} cube in the {self.target_colors[self.goal_target]} bowl"

    # phases of a pick-and-place and how often :meth:`pose` draws each by default ("start" and
    # "transit" come last at weight 0, so the default draws are those of the mix before them)
    POSE_PHASES = {"free": 0.1, "approach": 0.45, "carry": 0.35, "placed": 0.1, "start": 0.0, "transit": 0.0}
    # rad: the gripper angle at which the closed pads just touch a cube's faces, and the lowest
    # reading of a held cube in oracle carries (~5th percentile of 20 oracle episodes; median 0.53)
    CARRY_GRIP_TOUCH = (so101.CUBE_HALF - so101.PAD_INNER_GAP) / so101.GRIP_M_PER_RAD
    CARRY_GRIP_LOW = 0.25

    def _sample_pose(self, rng, phase):
        """A pose of one of :attr:`POSE_PHASES`, around the named cube and bowl as the oracle
        moves: ``start`` (the arm at its reset pose, give or take the reset's joint noise),
        ``transit`` (on the way from there to above the cube), ``approach`` (tcp above or at
        the cube, jaws along a face), ``carry`` (the cube held between the closed jaws, on the
        way to the bowl), ``placed`` (the cube in the bowl, the gripper open above it), or
        ``free`` (anywhere, the objects untouched)."""
        adr = self._cube_qadr[self.goal_cube]
        cube = self.data.qpos[adr : adr + 3].copy()
        w, _, _, z = self.data.qpos[adr + 3 : adr + 7]
        cube_yaw = 2.0 * math.atan2(z, w)
        bowl = self.data.mocap_pos[self._target_mocap[self.goal_target]].copy()
        open_max = float(so101.JOINT_HIGH[5])
        if phase == "free":
            return ArmEnv._sample_pose(self, rng, phase)
        if phase == "start":
            return self._start_joints(rng), open_max
        if phase == "transit":
            home, _ = self.ik.fk(self._home)
            t = rng.uniform(0.0, 1.0)
            tcp = (1 - t) * home + t * np.array([cube[0], cube[1], 0.07]) + rng.normal(0.0, 0.01, 3)
            yaw = cube_yaw + rng.integers(4) * np.pi / 2
            return self._pose_at(tcp, rng, yaw if t > 0.5 else None), float(rng.uniform(1.0, open_max))
        if phase == "approach":
            spread = 0.03 if rng.random() < 0.5 else 0.008
            tcp = np.array([*(cube[:2] + rng.normal(0.0, spread, 2)), rng.uniform(so101.CUBE_HALF + 0.001, 0.09)])
            yaw = cube_yaw + rng.integers(4) * np.pi / 2 + rng.normal(0.0, 0.1)
            grip = rng.uniform(0.0, open_max) if rng.random() < 0.3 else rng.uniform(1.0, open_max)
            return self._pose_at(tcp, rng, yaw), float(grip)
        if phase == "carry":
            t = rng.uniform(0.0, 1.0)
            xy = (1 - t) * cube[:2] + t * bowl[:2] + rng.normal(0.0, 0.01, 2)
            q = self._pose_at(np.array([*xy, rng.uniform(0.03, 0.09)]), rng)
            tcp, _ = self.ik.fk(q)
            jaw = self.ik.gripper_yaw(q)
            self.data.qpos[adr : adr + 3] = tcp - np.array([0.0, 0.0, 0.001])
            self.data.qpos[adr + 3 : adr + 7] = (np.cos(jaw / 2), 0.0, 0.0, np.sin(jaw / 2))
            # the gripper's reading on a held cube: in simulation the closed fingers press into it,
            # so oracle carries read below the touching angle; a locator that reads the joints
            # must see those readings here too (a fixed touching angle made every real carry
            # look unlike the posed ones: the cube estimate was 2.9 cm off on oracle carries)
            return q, float(rng.uniform(self.CARRY_GRIP_LOW, self.CARRY_GRIP_TOUCH))
        # placed: the cube rests on the bowl's floor (a 3 mm disc), the open gripper above it
        off = rng.normal(0.0, 0.008, 2)
        off *= min(1.0, (so101.BOWL_RADIUS - 0.015) / max(float(np.linalg.norm(off)), 1e-9))
        yaw = rng.uniform(-np.pi, np.pi)
        self.data.qpos[adr : adr + 3] = (bowl[0] + off[0], bowl[1] + off[1], so101.CUBE_HALF + 0.003)
        self.data.qpos[adr + 3 : adr + 7] = (np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2))
        tcp = np.array([*(bowl[:2] + off + rng.normal(0.0, 0.01, 2)), rng.uniform(0.045, 0.10)])
        return self._pose_at(tcp, rng, yaw), float(rng.uniform(1.0, open_max))

    def _start_episode(self):
        self._wrong_object = False  # no other cube lifted yet in this episode
        return super()._start_episode()

    def step(self, action):
        """The base step, plus ``wrong_object``: a cube other than the named one was lifted (its
        centre more than :data:`WRONG_OBJECT_LIFT` above its resting height) at any step of the
        episode so far; in ``info`` every step and in ``episode_metrics`` at the end."""
        obs, reward, terminated, truncated, info = super().step(action)
        heights = info["cube_pos"][:, 2] - so101.CUBE_HALF
        others = np.arange(self.num_cubes) != self.goal_cube
        self._wrong_object = bool(self._wrong_object or np.any(heights[others] > WRONG_OBJECT_LIFT))
        info["wrong_object"] = self._wrong_object
        if "episode_metrics" in info:
            info["episode_metrics"]["wrong_object"] = self._wrong_object
        return obs, reward, terminated, truncated, info

    def _evaluate(self):
        d = self.data
        cube = d.xpos[self._cube_body[self.goal_cube]]
        bowl = d.mocap_pos[self._target_mocap[self.goal_target]]
        dist = _dist(cube[:2], bowl[:2])
        opening = 2 * (self._finger_mean() + so101.PAD_INNER_GAP)
        released = opening > 2 * so101.CUBE_HALF + 0.006
        success = dist < so101.BOWL_RADIUS - 0.012 and cube[2] < so101.CUBE_HALF + 0.006 and released
        reach = _dist(d.site_xpos[self._tcp], cube)
        bonus = 1.0 if success else 0.0
        if self.reward_mode == "staged":
            lifted = cube[2] > so101.CUBE_HALF + 0.0075
            held = lifted and reach < 0.02
            place = 1.0 - math.tanh(10.0 * dist) if (held or dist < so101.BOWL_RADIUS) else 0.0
            terms = 1.0 - math.tanh(REACH_SHARPNESS * reach) + float(held) + place
            if self.align_weight:
                tcp = d.site_xpos[self._tcp]
                align = 1.0 if lifted else 1.0 - math.tanh(100.0 * _dist(tcp[:2], cube[:2]))
                terms += self.align_weight * align
            return success, terms / (3.0 + self.align_weight) - 1.0 + bonus, dist
        # dense reward: reach the cube, bring it over the bowl (horizontal distance only, so lifting it
        # over the bowl's wall costs nothing), and the success bonus for letting go inside
        return success, -reach - 2.0 * dist + bonus, dist
