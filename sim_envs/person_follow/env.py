"""``robopolicy/PersonFollow-v0``: a differential-drive robot follows one person among others.

The robot and the people are kinematic (mocap bodies); a step integrates the unicycle model,
advances each person's scripted walk, then runs ``mj_kinematics`` for rendering and for the
ray-cast visibility check. See ``metrics.py`` for the success / tracking definitions and
``scenario.py`` for what an episode looks like.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import gymnasium
import mujoco
import numpy as np
from gymnasium import spaces

from sim_envs.core import check_action, check_choice, check_options
from sim_envs.person_follow import metrics as M
from sim_envs.person_follow.geometry import bearing, clearance, free_run, nearest_hazard, wrap_angle
from sim_envs.person_follow.people import INSTRUCTION_CHARSET, SHIRT_COLORS, TROUSER_COLORS
from sim_envs.person_follow.scenario import Scenario, generate_scenario, retarget
from sim_envs.person_follow.scene import (
    FRONT_GROUPS,
    HIDDEN_Z,
    MAX_OBSTACLES,
    MAX_PEOPLE,
    PERSON_PARTS,
    ROBOT_RADIUS,
    ROOM_HALF,
    SHIRT_PARTS,
    TOPDOWN_GROUPS,
    TROUSER_PARTS,
    build_mjcf,
    geom_bounds,
    person_layout,
)

SPLITS = ("stt", "dt", "at")
INSTRUCTION_MODES = ("normal", "swap")
CONTROL_HZ = 10
DT = 1.0 / CONTROL_HZ
FREE_RUN_RANGE = 8.0  # m: free_run_label saturates here (half the room; the oracle's view is rarely blocked within 3 m)
FREE_RUN_RAYS = 9  # free_run_label: rays across the front camera's field of view, left to right
YIELD_ROBOT = 0.95  # a person waits rather than step within this distance of the robot
YIELD_PERSON = 0.7  # ... or of a higher-priority person (the target has top priority)
_GEOM_TYPES = {"sphere": mujoco.mjtGeom.mjGEOM_SPHERE, "capsule": mujoco.mjtGeom.mjGEOM_CAPSULE, "cylinder": mujoco.mjtGeom.mjGEOM_CYLINDER}


def _visibility_points(height: float) -> tuple[np.ndarray, np.ndarray]:
    """Body-frame sample points on the axes of a person's geoms, and each geom's radius."""
    lay = person_layout(height)
    pts, rad = [], []
    for side in ("leg_l", "leg_r"):
        _, (r, hl), (x, y, z) = lay[side]
        for f in (-1.0, -0.33, 0.33, 1.0):
            pts.append((x, y, z + f * hl))
            rad.append(r)
    _, (r, hl), (x, y, z) = lay["torso"]
    for f in (-1.0, -0.33, 0.33, 1.0):
        for lat in (-0.09, 0.0, 0.09):
            pts.append((x, lat, z + f * hl))
            rad.append(r - abs(lat))
    for side in ("arm_l", "arm_r"):
        _, (r, hl), (x, y, z) = lay[side]
        for f in (-0.7, 0.7):
            pts.append((x, y, z + f * hl))
            rad.append(r)
    _, (r,), (x, y, z) = lay["head"]
    for dz in (-0.5 * r, 0.4 * r):
        pts.append((x, y, z + dz))
        rad.append(r)
    return np.asarray(pts, dtype=np.float64), np.asarray(rad, dtype=np.float64)


def _multi_ray(m, d, pnt, vec, groups, exclude, geomid, dist, n):
    try:
        mujoco.mj_multiRay(m, d, pnt, vec, groups, 1, exclude, geomid, dist, None, n, 1e3)
    except TypeError:  # mujoco < 3.3.x: no normal output
        mujoco.mj_multiRay(m, d, pnt, vec, groups, 1, exclude, geomid, dist, n, 1e3)


class PersonFollowEnv(gymnasium.Env):
    """Follow the person named by the instruction (``task``) with a differential-drive robot.

    Args:
        split: "stt" (single / clearly different people), "dt" (distractors share some
            attributes; in 70% of episodes one starts at least as central and as near as the
            target, see ``scenario.py``), "at" (a look-alike is present; "follow the person in
            front of you").
        image_size: egocentric image size, an int (square) or (height, width).
        hfov_deg: horizontal field of view of the front camera.
        camera: render the front RGB image into the observation (False: state-only obs;
            visibility metrics still work, they use ray casts).
        depth: also return ``observation.images.front_depth`` (float32 metres, H x W x 1).
        v_max, omega_max: twist limits (action space is [-v_max, v_max] x [-omega_max, omega_max]).
        max_steps: episode cap (truncated at this many steps).
        render_mode: None or "rgb_array"; render() gives front + top-down side by side.
        render_size: height in pixels of the views of render() / render_views().
        num_others: fixed number of other people (None: random, 0-7 for stt, 1-7 otherwise).
        instruction: "normal", or "swap": the same scene (same seed, same people, same walks), but
            the instruction names another person, who becomes the target (the oracle and every
            metric follow the new target). The new target is drawn among the others who are
            visible and within ``FOLLOW_MAX_DISTANCE`` at t=0 and whose four attributes no one
            else shares; the instruction names all that tells them apart (the ``dt`` phrasing).
            An episode with no such person keeps its target and instruction;
            ``episode_metrics["retargeted"]`` says which happened. Also a reset option.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": CONTROL_HZ}

    def __init__(
        self,
        split: str = "stt",
        image_size: int | tuple[int, int] = 128,
        hfov_deg: float = 90.0,
        camera: bool = True,
        depth: bool = False,
        v_max: float = 1.2,
        omega_max: float = 1.5,
        max_steps: int = 300,
        render_mode: str | None = None,
        render_size: int = 256,
        num_others: int | None = None,
        substeps: int = 4,
        instruction: str = "normal",
    ):
        self.split = check_choice("split", split, SPLITS)
        self.instruction = check_choice("instruction", instruction, INSTRUCTION_MODES)
        check_choice("render_mode", render_mode, (None, "rgb_array"))
        self.render_mode = render_mode
        if isinstance(image_size, (int, np.integer)) and not isinstance(image_size, bool):
            image_size = (int(image_size), int(image_size))
        if not (
            isinstance(image_size, (tuple, list))
            and len(image_size) == 2
            and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and 16 <= s <= 1024 for s in image_size)
        ):
            raise ValueError(f"image_size must be an int or (height, width) of ints in [16, 1024], got {image_size!r}")
        self.image_hw = (int(image_size[0]), int(image_size[1]))
        if not (isinstance(hfov_deg, (int, float)) and 30.0 <= float(hfov_deg) <= 150.0):
            raise ValueError(f"hfov_deg must be a number in [30, 150], got {hfov_deg!r}")
        self.hfov_deg = float(hfov_deg)
        self._free_run_bearings = np.radians(np.linspace(0.5 * self.hfov_deg, -0.5 * self.hfov_deg, FREE_RUN_RAYS))
        check_choice("camera", camera, (True, False))
        check_choice("depth", depth, (True, False))
        if depth and not camera:
            raise ValueError("depth=True needs camera=True")
        self.camera, self.depth = bool(camera), bool(depth)
        for name, val in (("v_max", v_max), ("omega_max", omega_max)):
            if not (isinstance(val, (int, float)) and math.isfinite(val) and val > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {val!r}")
        self.v_max, self.omega_max = float(v_max), float(omega_max)
        if not (isinstance(max_steps, (int, np.integer)) and not isinstance(max_steps, bool) and max_steps >= 1):
            raise ValueError(f"max_steps must be an int >= 1, got {max_steps!r}")
        self.max_steps = int(max_steps)
        if not (isinstance(render_size, (int, np.integer)) and not isinstance(render_size, bool) and 32 <= render_size <= 1024):
            raise ValueError(f"render_size must be an int in [32, 1024], got {render_size!r}")
        self.render_size = int(render_size)
        self.num_others = self._check_num_others(num_others)
        if not (isinstance(substeps, (int, np.integer)) and 1 <= substeps <= 20):
            raise ValueError(f"substeps must be an int in [1, 20], got {substeps!r}")
        self.substeps = int(substeps)

        h, w = self.image_hw
        obs = {}
        if self.camera:
            obs["observation.images.front"] = spaces.Box(0, 255, (h, w, 3), np.uint8)
        if self.depth:
            obs["observation.images.front_depth"] = spaces.Box(0.0, np.inf, (h, w, 1), np.float32)
        lim = np.array([self.v_max, self.omega_max], dtype=np.float32)
        obs["observation.state"] = spaces.Box(-lim, lim, (2,), np.float32)
        obs["task"] = spaces.Text(max_length=256, min_length=1, charset=INSTRUCTION_CHARSET)
        self.observation_space = spaces.Dict(obs)
        self.action_space = spaces.Box(-lim, lim, (2,), np.float32)

        self.model = mujoco.MjModel.from_xml_string(build_mjcf(h, w, self.hfov_deg, self.render_size))
        self.data = mujoco.MjData(self.model)
        self._index_model()
        self._renderers: dict[tuple, mujoco.Renderer] = {}
        self._front_opt = mujoco.MjvOption()
        self._front_opt.geomgroup[:] = FRONT_GROUPS
        self._top_opt = mujoco.MjvOption()
        self._top_opt.geomgroup[:] = TOPDOWN_GROUPS
        self._ray_groups = np.array(FRONT_GROUPS, dtype=np.uint8)
        fovy = math.radians(float(self.model.cam_fovy[self._cam_front]))
        self._focal = 0.5 * h / math.tan(0.5 * fovy)
        self.scenario: Scenario | None = None
        self._episode_ready = False

    # ------------------------------------------------------------------ setup
    def _check_num_others(self, n):
        if n is None:
            return None
        if not (isinstance(n, (int, np.integer)) and not isinstance(n, bool) and 0 <= n <= MAX_PEOPLE - 1):
            raise ValueError(f"num_others must be None or an int in [0, {MAX_PEOPLE - 1}], got {n!r}")
        if self.split != "stt" and n < 1:
            raise ValueError(f"split {self.split!r} needs num_others >= 1, got {n}")
        return int(n)

    def _index_model(self):
        m = self.model
        name2id = lambda t, n: mujoco.mj_name2id(m, t, n)  # noqa: E731
        B, G = mujoco.mjtObj.mjOBJ_BODY, mujoco.mjtObj.mjOBJ_GEOM
        self._robot_body = name2id(B, "robot")
        self._robot_mocap = int(m.body_mocapid[self._robot_body])
        self._marker_mocap = int(m.body_mocapid[name2id(B, "target_marker")])
        self._person_body = np.array([name2id(B, f"person{i}") for i in range(MAX_PEOPLE)])
        self._person_mocap = np.array([m.body_mocapid[b] for b in self._person_body])
        self._person_geoms = {(i, p): name2id(G, f"p{i}_{p}") for i in range(MAX_PEOPLE) for p in PERSON_PARTS}
        self._obst_geoms = np.array([name2id(G, f"obst{k}") for k in range(MAX_OBSTACLES)])
        self._wall_geoms = np.array([name2id(G, n) for n in ("wall_px", "wall_nx", "wall_py", "wall_ny")])
        self._floor_mat = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_MATERIAL, "floor_mat")
        self._light = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_LIGHT, "sun")
        self._cam_front = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, "front")
        self._cam_top = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, "topdown")
        self._geom_body = np.asarray(m.geom_bodyid).copy()

    def _set_geom(self, gid: int, gtype: str, size, pos, quat=None):
        m = self.model
        size = tuple(float(s) for s in size)
        m.geom_size[gid, : len(size)] = size
        m.geom_pos[gid] = pos
        if quat is not None:
            m.geom_quat[gid] = quat
        rb, aabb = geom_bounds(gtype, size)
        m.geom_rbound[gid] = rb
        m.geom_aabb[gid, 3:] = aabb

    def _apply_scenario(self, sc: Scenario):
        m = self.model
        n = len(sc.people)
        # People: a random slot order so the target's slot carries no information.
        self._slots = self.np_random.permutation(MAX_PEOPLE)[:n]
        for i in range(MAX_PEOPLE):
            for p in PERSON_PARTS:
                m.geom_rgba[self._person_geoms[(i, p)], 3] = 0.0
        for k, app in enumerate(sc.people):
            i = int(self._slots[k])
            lay = person_layout(app.height)
            for p in PERSON_PARTS:
                gid = self._person_geoms[(i, p)]
                gtype, size, pos = lay[p]
                self._set_geom(gid, gtype, size, pos)
                if p in SHIRT_PARTS:
                    rgb = SHIRT_COLORS[app.shirt]
                elif p in TROUSER_PARTS:
                    rgb = TROUSER_COLORS[app.trousers]
                elif p == "hat":
                    rgb = app.hat_rgb
                else:
                    rgb = app.skin_rgb
                alpha = 0.0 if (p == "hat" and not app.hat) else 1.0
                m.geom_rgba[gid] = (*rgb, alpha)
        # Obstacles
        for k in range(MAX_OBSTACLES):
            gid = int(self._obst_geoms[k])
            if not sc.obstacle_mask[k]:
                m.geom_pos[gid] = (0.0, 0.0, HIDDEN_Z)
                m.geom_rgba[gid, 3] = 0.0
                continue
            x, y, yaw, hx, hy, kind = sc.obstacles[k]
            hz = 0.5 * sc.obstacle_height[k]
            quat = (math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))
            if kind == 0:
                self._set_geom(gid, "box", (hx, hy, hz), (x, y, hz), quat)
            else:
                self._set_geom(gid, "cylinder", (hx, hz), (x, y, hz), quat)
            m.geom_rgba[gid] = (*sc.looks["obstacle_rgb"][k], 1.0)
        looks = sc.looks
        m.mat_rgba[self._floor_mat] = looks["floor_rgba"]
        for gid in self._wall_geoms:
            m.geom_rgba[gid] = looks["wall_rgba"]
        d = looks["light_dir"]
        m.light_dir[self._light] = d / np.linalg.norm(d)
        m.light_diffuse[self._light] = looks["light_diffuse"]
        m.vis.headlight.ambient[:] = looks["ambient"]
        self._people_arrays(sc)
        self._obstacles_active = sc.obstacles[sc.obstacle_mask].copy()
        self._obstacles_info = np.concatenate([sc.obstacles, sc.obstacle_height[:, None]], axis=1).astype(np.float32)
        self._obstacle_mask = sc.obstacle_mask.copy()
        self._nvis = len(self._person_vis[0][0])  # the same sample layout for every height
        self._ray_geomid = np.zeros(self._nvis, dtype=np.int32)
        self._ray_dist = np.zeros(self._nvis, dtype=np.float64)

    def _people_arrays(self, sc: Scenario):
        """The per-episode arrays that follow the order of ``sc.people`` (the target first)."""
        n = len(sc.people)
        self._target_slot = int(self._slots[0])
        self._n_people = n
        horizon = self.max_steps + 2
        self._trajs = np.zeros((n, horizon, 3))
        for k, tr in enumerate(sc.trajs):
            t = min(len(tr), horizon)
            self._trajs[k, :t] = tr[:t]
            self._trajs[k, t:] = tr[t - 1]
        self._target_ticks = int(sc.target_ticks)
        self._reference_steps = int(min(sc.target_ticks, self.max_steps))
        self._person_vis = [_visibility_points(app.height) for app in sc.people]

    # ------------------------------------------------------------------ gym API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        options = check_options(options, ("num_others", "instruction"))
        super().reset(seed=seed)
        n_others = self._check_num_others(options["num_others"]) if "num_others" in options else self.num_others
        mode = check_choice("instruction", options.get("instruction", self.instruction), INSTRUCTION_MODES)
        sc = generate_scenario(self.np_random, self.split, self.max_steps, DT, n_others)
        self._apply_scenario(sc)
        self._start(sc)
        self._retargeted = False
        if mode == "swap":
            new = self._swap_candidate()
            if new is not None:
                order = [new, *(k for k in range(len(sc.people)) if k != new)]
                sc = retarget(sc, order, self.np_random)
                self._slots = self._slots[order]  # the same people in the same slots (the scene is unchanged)
                self._people_arrays(sc)
                self._start(sc)
                self._retargeted = True
        info = self._evaluate(ended=False)
        return self._observation(), info

    def _start(self, sc: Scenario) -> None:
        """Everything that changes within an episode, at its start."""
        self.scenario = sc
        self._clock = np.zeros(self._n_people, dtype=np.int64)
        self._ppos = self._trajs[:, 0, :].copy()
        self._pvel = np.zeros((self._n_people, 2))
        self._poff = np.zeros((self._n_people, 2))
        self._robot = sc.robot_start.astype(np.float64).copy()
        self._twist = np.zeros(2, dtype=np.float32)
        self._steps = 0
        self._lost_counter = 0
        self._following_steps = 0
        self._contact = False
        self._task = sc.instruction
        self._episode_ready = True
        self._sync_sim()

    def _swap_candidate(self) -> int | None:
        """Index of a person (not the target) the ``swap`` instruction may name: visible and within
        follow range now, with attributes no one else shares; drawn at random among those."""
        people = self.scenario.people
        dists = np.hypot(*(self._ppos[:, :2] - self._robot[:2]).T)
        ok = [k for k in range(1, len(people))
              if dists[k] <= M.FOLLOW_MAX_DISTANCE and M.is_visible(self._visibility(k)[0])
              and sum(p.attributes() == people[k].attributes() for p in people) == 1]
        return int(self.np_random.choice(ok)) if ok else None

    def step(self, action):
        if not self._episode_ready:
            raise RuntimeError("call reset() before step()")
        a = check_action(action, self.action_space)
        info = self._advance(np.clip(a, self.action_space.low, self.action_space.high))
        obs = self._observation()
        terminated = bool(info["_terminated"])
        truncated = bool(not terminated and self._steps >= self.max_steps)
        del info["_terminated"]
        if terminated or truncated:
            info["episode_metrics"] = self.episode_metrics_now(info)
            self._episode_ready = False
        return obs, 0.0, terminated, truncated, info

    _DYNAMIC = ("_clock", "_ppos", "_pvel", "_poff", "_robot", "_twist", "_steps", "_lost_counter",
                "_following_steps", "_contact", "_last_metrics")  # _retargeted is fixed at reset

    def get_state(self) -> dict:
        """A copy of everything that changes within an episode (robot, people, counters); the
        scenario itself is fixed at reset. :meth:`set_state` puts it back."""
        return {k: copy.deepcopy(getattr(self, k)) for k in self._DYNAMIC}

    def set_state(self, state: dict) -> None:
        missing = [k for k in self._DYNAMIC if k not in state]
        if missing:
            raise ValueError(f"set_state: the state lacks {missing}")
        for k in self._DYNAMIC:
            setattr(self, k, copy.deepcopy(state[k]))
        self._sync_sim()

    def oracle_recovers(self, info: dict, horizon: int, state: dict | None = None) -> bool:
        """Whether the privileged oracle, taking over from the current state (or from ``state``, a
        :meth:`get_state` of this episode whose step info is ``info``), avoids collision and loss
        for the next ``horizon`` steps (or to the episode's end). A counterfactual: the oracle
        drives without rendering and the env is put back as it was, so the episode continues as
        if it had not been asked."""
        from sim_envs.person_follow.oracle import PersonFollowOracle

        saved = self.get_state()
        if state is not None:
            self.set_state(state)
        oracle = PersonFollowOracle(self.action_space, dt=DT)
        try:
            for _ in range(int(horizon)):
                if self._steps >= self.max_steps:
                    return True
                info = self._advance(oracle.label({"observation.state": self._twist.copy()}, info).action)
                if info["metrics"]["collision"] or info["metrics"]["lost"]:
                    return False
                if info["_terminated"]:  # the target reached its goal and waits
                    return True
            return True
        finally:
            self.set_state(saved)

    def free_run_label(self, info: dict) -> np.ndarray:
        """The spatial grounding label of the state ``info`` describes: how far the robot could
        drive in a straight line before its rim touches an obstacle or wall, along
        ``FREE_RUN_RAYS`` bearings spread across the front camera's field of view from left to
        right (the middle one straight ahead), to 0.1 m, capped at ``FREE_RUN_RANGE``:
        ``(FREE_RUN_RAYS,)`` float32 metres. Computed on request (~0.35 ms), not every step."""
        obstacles = np.asarray(info["obstacles"], dtype=np.float64)[np.asarray(info["obstacle_mask"], dtype=bool)]
        return free_run(np.asarray(info["robot_pose"], dtype=np.float64), ROBOT_RADIUS, obstacles,
                        float(info["room_half_extent"]), FREE_RUN_RANGE, self._free_run_bearings, step=0.1).astype(np.float32)

    def hazard_twist(self, info: dict, speed: float = 0.8, gain: float = 2.0) -> np.ndarray:
        """A scripted push toward trouble, for collecting the states a policy must recover from:
        the twist ``(v, omega)`` that drives at ``speed`` (m/s) toward the nearest point of an
        obstacle or wall (from the privileged ``info``), turning at ``gain`` x its bearing. It
        does not stop short: the caller decides when to hand control back."""
        pose = np.asarray(info["robot_pose"], dtype=np.float64)
        obstacles = np.asarray(info["obstacles"], dtype=np.float64)[np.asarray(info["obstacle_mask"], dtype=bool)]
        point, _gap = nearest_hazard(pose, ROBOT_RADIUS, obstacles, float(info["room_half_extent"]))
        off = bearing(pose, point)
        # turn in place while the hazard is well off to the side, then drive at it
        v = min(float(speed), self.v_max) * max(0.0, math.cos(off))
        w = float(np.clip(gain * off, -self.omega_max, self.omega_max))
        return np.array([v, w], dtype=np.float32)

    def _advance(self, a: np.ndarray) -> dict:
        """One control step of the robot and the people from a clipped twist ``a``; the step's
        info with ``_terminated`` (no observation is rendered)."""
        v, w = float(a[0]), float(a[1])
        # Robot: unicycle integration with sub-steps; touching an obstacle or wall ends it.
        x, y, th = (float(q) for q in self._robot)
        h = DT / self.substeps
        contact = False
        for _ in range(self.substeps):
            dth = w * h
            if abs(dth) < 1e-6:
                x += v * h * math.cos(th + 0.5 * dth)
                y += v * h * math.sin(th + 0.5 * dth)
            else:
                x += v / w * (math.sin(th + dth) - math.sin(th))
                y -= v / w * (math.cos(th + dth) - math.cos(th))
            th = (th + dth + math.pi) % (2.0 * math.pi) - math.pi
            if self._robot_clearance(x, y) < ROBOT_RADIUS:
                contact = True
                break
        self._robot[:] = (x, y, th)
        self._twist[:] = (v, w)
        self._contact = contact
        self._advance_people()
        self._steps += 1
        self._sync_sim()
        return self._evaluate(ended=None)

    # ------------------------------------------------------------------ dynamics
    def _robot_clearance(self, x: float, y: float) -> float:
        d = ROOM_HALF - max(abs(x), abs(y))
        if d < ROBOT_RADIUS:
            return d
        ob = self._obstacles_active
        if len(ob):
            # cheap bounding-circle rejection before the exact footprint distance
            near = np.hypot(ob[:, 0] - x, ob[:, 1] - y) - np.hypot(ob[:, 3], ob[:, 4]) < ROBOT_RADIUS + 0.05
            if near.any():
                d = min(d, float(clearance(np.array([x, y]), ob[near], ROOM_HALF)))
        return d

    def _advance_people(self):
        """Advance each person's scripted clock by one tick unless it has to yield.

        A person about to step within YIELD_ROBOT of the robot steps around it instead (onto
        that circle, if this is no longer than 1.5 nominal steps) or waits; a person about to
        step within YIELD_PERSON of a higher-priority person waits. Side-steps are kept as an
        offset from the scripted path that decays back to it.
        """
        rx, ry = float(self._robot[0]), float(self._robot[1])
        old = self._ppos[:, :2].copy()
        new_all = self._ppos.copy()
        last = self._trajs.shape[1] - 1
        for k in range(self._n_people):
            c = self._clock[k]
            nxt = self._trajs[k, min(c + 1, last)].copy()
            off = self._poff[k] * 0.85
            nxt[:2] += off
            ox, oy = old[k]
            hold = False
            d_new = math.hypot(nxt[0] - rx, nxt[1] - ry)
            if d_new < YIELD_ROBOT and d_new < math.hypot(ox - rx, oy - ry):
                nominal = math.hypot(nxt[0] - ox, nxt[1] - oy)
                scale = YIELD_ROBOT / max(d_new, 1e-6)
                px, py = rx + (nxt[0] - rx) * scale, ry + (nxt[1] - ry) * scale
                if nominal > 1e-3 and math.hypot(px - ox, py - oy) <= 1.5 * nominal and self._walkable(px, py):
                    off = off + np.array([px - nxt[0], py - nxt[1]])
                    nxt[0], nxt[1] = px, py
                else:
                    hold = True
            if not hold:
                for j in range(k):  # higher priority people (target first), at their new poses
                    pj = new_all[j, :2]
                    dn = math.hypot(nxt[0] - pj[0], nxt[1] - pj[1])
                    if dn < YIELD_PERSON and dn < math.hypot(ox - pj[0], oy - pj[1]):
                        hold = True
                        break
            if not hold:
                self._clock[k] = min(c + 1, last)
                self._poff[k] = off
                new_all[k] = nxt
        self._pvel = (new_all[:, :2] - old) / DT
        self._ppos = new_all

    def _walkable(self, x: float, y: float) -> bool:
        if ROOM_HALF - max(abs(x), abs(y)) < 0.4:
            return False
        ob = self._obstacles_active
        return not len(ob) or float(clearance(np.array([x, y]), ob, ROOM_HALF)) >= 0.3

    def _sync_sim(self):
        d = self.data
        x, y, th = self._robot
        d.mocap_pos[self._robot_mocap] = (x, y, 0.0)
        d.mocap_quat[self._robot_mocap] = (math.cos(th / 2), 0.0, 0.0, math.sin(th / 2))
        for i in range(MAX_PEOPLE):
            d.mocap_pos[self._person_mocap[i]] = (2.0 * i, 0.0, HIDDEN_Z)
        for k in range(self._n_people):
            px, py, pth = self._ppos[k]
            mid = self._person_mocap[self._slots[k]]
            d.mocap_pos[mid] = (px, py, 0.0)
            d.mocap_quat[mid] = (math.cos(pth / 2), 0.0, 0.0, math.sin(pth / 2))
        tx, ty = self._ppos[0, :2]
        d.mocap_pos[self._marker_mocap] = (tx, ty, 0.0)
        mujoco.mj_kinematics(self.model, d)
        mujoco.mj_camlight(self.model, d)

    # ------------------------------------------------------------------ perception
    def _target_visibility(self) -> tuple[float, np.ndarray]:
        """Fraction of the target's sample points in frame and unoccluded, and its pixel box."""
        return self._visibility(0)

    def _visibility(self, k: int) -> tuple[float, np.ndarray]:
        """Fraction of person ``k``'s sample points in frame and unoccluded, and its pixel box."""
        d = self.data
        px, py, pth = self._ppos[k]
        c, s = math.cos(pth), math.sin(pth)
        lp, vis_rad = self._person_vis[k]
        world = np.empty_like(lp)
        world[:, 0] = px + c * lp[:, 0] - s * lp[:, 1]
        world[:, 1] = py + s * lp[:, 0] + c * lp[:, 1]
        world[:, 2] = lp[:, 2]
        cam_pos = d.cam_xpos[self._cam_front]
        cam_mat = d.cam_xmat[self._cam_front].reshape(3, 3)
        rel = world - cam_pos
        pc = rel @ cam_mat  # camera-frame coordinates (camera looks along -z)
        depth = -pc[:, 2]
        h, w = self.image_hw
        front = depth > 0.05
        safe = np.where(front, depth, 1.0)
        u = 0.5 * w + self._focal * pc[:, 0] / safe
        vpx = 0.5 * h - self._focal * pc[:, 1] / safe
        in_frame = front & (u >= 0) & (u < w) & (vpx >= 0) & (vpx < h)
        if not np.any(in_frame):
            return 0.0, np.zeros(4, dtype=np.float32)
        vec = np.ascontiguousarray(rel).ravel()
        _multi_ray(self.model, d, np.ascontiguousarray(cam_pos, dtype=np.float64), vec, self._ray_groups,
                   self._robot_body, self._ray_geomid, self._ray_dist, self._nvis)
        gid = self._ray_geomid
        hit_target = (gid >= 0) & (self._geom_body[np.maximum(gid, 0)] == self._person_body[self._slots[k]])
        visible = in_frame & hit_target
        frac = float(np.count_nonzero(visible)) / self._nvis
        if not np.any(visible):
            return frac, np.zeros(4, dtype=np.float32)
        rpx = self._focal * vis_rad[visible] / safe[visible]
        uu, vv = u[visible], vpx[visible]
        box = np.array([
            max(0.0, float(np.min(uu - rpx))),
            max(0.0, float(np.min(vv - rpx))),
            min(float(w), float(np.max(uu + rpx))),
            min(float(h), float(np.max(vv + rpx))),
        ], dtype=np.float32)
        return frac, box

    def _evaluate(self, ended: bool | None) -> dict:
        robot_xy = self._robot[:2]
        rel = self._ppos[:, :2] - robot_xy
        dists = np.hypot(rel[:, 0], rel[:, 1])
        distance = float(dists[0])
        frac, box = self._target_visibility()
        self._lost_counter = M.update_lost_counter(self._lost_counter, distance) if self._steps > 0 else 0
        sm = M.step_metrics(distance, frac, float(dists.min()), self._contact, self._lost_counter)
        if self._steps > 0 and sm["following"]:
            self._following_steps += 1
        target_done = bool(self._clock[0] >= self._target_ticks)
        terminated = bool(sm["collision"] or sm["lost"] or (self._steps > 0 and target_done))
        info = self._info(sm, frac, box, distance)
        info["_terminated"] = terminated
        if ended is False:
            del info["_terminated"]
        self._last_metrics = sm
        return info

    def _info(self, sm: dict, frac: float, box: np.ndarray, distance: float) -> dict:
        poses = np.zeros((MAX_PEOPLE, 3), dtype=np.float32)
        vels = np.zeros((MAX_PEOPLE, 2), dtype=np.float32)
        mask = np.zeros(MAX_PEOPLE, dtype=bool)
        poses[self._slots] = self._ppos
        vels[self._slots] = self._pvel
        mask[self._slots] = True
        rel = self._ppos[0, :2] - self._robot[:2]
        target_bearing = float(wrap_angle(math.atan2(rel[1], rel[0]) - self._robot[2]))
        return {
            "robot_pose": self._robot.astype(np.float32),
            "robot_velocity": self._twist.copy(),
            "people_poses": poses,
            "people_velocities": vels,
            "people_mask": mask,
            "target_index": self._target_slot,
            "target_box": box,
            "target_visible": bool(sm["visible"]),
            "target_visible_fraction": float(frac),
            "target_distance": float(distance),
            "target_bearing": target_bearing,
            "obstacles": self._obstacles_info.copy(),
            "obstacle_mask": self._obstacle_mask.copy(),
            "room_half_extent": float(ROOM_HALF),
            # the gap between the robot's rim and the nearest obstacle or wall (m; < 0: touching)
            "robot_clearance": float(clearance(self._robot[:2].astype(np.float64), self._obstacles_active, ROOM_HALF))
            - ROBOT_RADIUS,
            "reference_steps": self._reference_steps,
            "metrics": sm,
            "is_success": bool(sm["success"]),
        }

    def episode_metrics_now(self, info: dict) -> dict:
        """The episode metrics as if the episode ended at this step (``info``: this step's info).
        The env puts them in ``info["episode_metrics"]`` when it ends an episode; a caller that ends
        one early (an evaluation's own step cap) asks for them here."""
        sm = info["metrics"]
        return M.episode_metrics(
            following_steps=self._following_steps,
            steps=self._steps,
            reference_steps=self._reference_steps,
            success=sm["success"],
            collision=sm["collision"],
            lost=sm["lost"],
            person_collision=sm["min_person_distance"] < M.COLLISION_DISTANCE,
            wrong_target=self._followed_person() not in (None, 0),
            retargeted=self._retargeted,
        )

    def _followed_person(self) -> int | None:
        """The person the robot is following now (:func:`metrics.followed_person`): index into the
        scenario's people (0: the target), or None."""
        rel = self._ppos[:, :2] - self._robot[:2]
        bearings = wrap_angle(np.arctan2(rel[:, 1], rel[:, 0]) - self._robot[2])
        fractions = [self._visibility(k)[0] for k in range(self._n_people)]
        return M.followed_person(np.hypot(rel[:, 0], rel[:, 1]), np.asarray(fractions), bearings)

    # ------------------------------------------------------------------ rendering
    def _renderer(self, h: int, w: int, kind: str = "rgb") -> mujoco.Renderer:
        key = (h, w, kind)
        r = self._renderers.get(key)
        if r is None:
            r = mujoco.Renderer(self.model, h, w)
            if kind == "depth":
                r.enable_depth_rendering()
            elif kind == "seg":
                r.enable_segmentation_rendering()
            self._renderers[key] = r
        return r

    def _observation(self) -> dict:
        obs = {}
        h, w = self.image_hw
        if self.camera:
            r = self._renderer(h, w)
            r.update_scene(self.data, camera=self._cam_front, scene_option=self._front_opt)
            obs["observation.images.front"] = r.render()
        if self.depth:
            r = self._renderer(h, w, "depth")
            r.update_scene(self.data, camera=self._cam_front, scene_option=self._front_opt)
            obs["observation.images.front_depth"] = r.render().astype(np.float32)[:, :, None]
        obs["observation.state"] = self._twist.copy()
        obs["task"] = self._task
        return obs

    def render_views(self) -> dict[str, np.ndarray]:
        """Front camera (at render_size height, same aspect) and the top-down overview."""
        if self.scenario is None:
            raise RuntimeError("call reset() before rendering")
        h, w = self.image_hw
        rh = self.render_size
        rw = max(16, int(round(rh * w / h)))
        r = self._renderer(rh, rw)
        r.update_scene(self.data, camera=self._cam_front, scene_option=self._front_opt)
        front = r.render()
        r = self._renderer(rh, rh)
        r.update_scene(self.data, camera=self._cam_top, scene_option=self._top_opt)
        top = r.render()
        return {"front": front, "topdown": top}

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        views = self.render_views()
        return np.concatenate([views["front"], views["topdown"]], axis=1)

    def segment_target(self) -> np.ndarray:
        """Boolean mask (H x W) of the target's pixels in the front image (segmentation render)."""
        h, w = self.image_hw
        r = self._renderer(h, w, "seg")
        r.update_scene(self.data, camera=self._cam_front, scene_option=self._front_opt)
        seg = r.render()
        ids = seg[:, :, 0]
        geom_type = seg[:, :, 1] == int(mujoco.mjtObj.mjOBJ_GEOM)
        body = self._geom_body[np.clip(ids, 0, self.model.ngeom - 1)]
        return geom_type & (ids >= 0) & (body == self._person_body[self._target_slot])

    def make_oracle(self, noise: float = 0.0, seed: int | None = None):
        from sim_envs.person_follow.oracle import PersonFollowOracle

        return PersonFollowOracle(self.action_space, noise=noise, seed=seed, dt=DT)

    def close(self):
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()
