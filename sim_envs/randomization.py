"""Domain randomisation of a MuJoCo task at every reset: lighting, scenery colours, camera pose,
distractor objects. Off unless asked for; seeded; the task itself (layout, instruction, physics,
success) is the same with it on or off.

    env = DomainRandomization(gymnasium.make("robopolicy/ArmPushCube-v0"),
                              {"lighting": True, "textures": True, "camera_jitter": True, "distractors": 3, "seed": 0})

As a task config (``robopolicy.envs.EnvConfig.randomize``; every command that builds a task
applies it, and an evaluation without it sees the nominal scene)::

    env:
      id: robopolicy/ArmPushCube-v0
      randomize: {lighting: true, textures: true, camera_jitter: true, distractors: 3}

What each setting changes in the MuJoCo model, drawn afresh at every reset from the nominal values
(nothing drifts from one episode to the next):

- ``lighting``: each light's diffuse colour (brightness x0.4-1.4, a slight tint), position (±0.3 m)
  and direction (tilted up to about 17°); the headlight's ambient and diffuse brightness (x0.6-1.3).
- ``textures``: the colour of every scenery geom (the table, the robot's links): a random colour
  mixed in by up to 60%. The task's objects keep their colours, which instructions name: geoms of
  free-floating or mocap bodies, and any geom whose colour the task's own reset sets.
- ``camera_jitter``: every camera's mount moves up to 1.5 cm and turns up to 3°.
- ``distractors``: that many of the scene's hidden visual-only geoms (named ``distractor<i>``;
  the arm scenes have four) appear on the table at random places clear of the task's objects
  (6 cm), in random colours and sizes. They have no contact and no mass (each is a mocap body of
  its own, which the randomisation moves).

Seeding: the draws of a reset with ``seed=s`` come from ``(randomize.seed, s)``, so an episode's
look is fixed by its seed as its layout is; a reset without a seed continues the wrapper's stream.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import gymnasium
import mujoco
import numpy as np

LIGHT_SCALE = (0.4, 1.4)
LIGHT_SHIFT = 0.3
"""m, per axis."""
LIGHT_TILT = 0.3
"""Direction change (a random vector of up to this length added to the unit direction)."""
HEADLIGHT_SCALE = (0.6, 1.3)
TEXTURE_MIX = 0.6
CAMERA_SHIFT = 0.015
"""m, per axis."""
CAMERA_TURN = math.radians(3.0)
DISTRACTOR_REGION = (0.09, 0.30, -1.4, 1.4)
"""Where distractors are placed on the table: radius (m) and angle (rad) around the robot base."""
DISTRACTOR_CLEARANCE = 0.06
"""m between a distractor and any task object (free or mocap body) in the table plane."""
HIDDEN_GROUP = 4
OBSERVATION_HOOKS = ("_obs", "_observation")
"""Methods of our tasks that render the current observation without side effects (the arm tasks',
PersonFollow's): textures and distractors are drawn after the task's reset (they depend on what the
reset set and placed), so its first observation is rendered again through one of them."""


def _observation_hook(base: gymnasium.Env):
    """The task's own observation renderer (:data:`OBSERVATION_HOOKS`), ``None`` if it has none."""
    return next((getattr(base, n) for n in OBSERVATION_HOOKS if callable(getattr(base, n, None))), None)


@dataclass(frozen=True)
class RandomizeSettings:
    """What :class:`DomainRandomization` varies (every setting off by default)."""

    lighting: bool = False
    textures: bool = False
    camera_jitter: bool = False
    distractors: int = 0
    """How many distractor objects to show (0: none)."""
    seed: int = 0

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "randomize") -> "RandomizeSettings":
        """Settings from a config mapping; unknown keys and wrong types raise ``ValueError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {sorted(known)})")
        for key in ("lighting", "textures", "camera_jitter"):
            if not isinstance(values.get(key, False), bool):
                raise ValueError(f"{where}.{key} must be true or false, got {values[key]!r}")
        for key in ("distractors", "seed"):
            v = values.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ValueError(f"{where}.{key} must be an integer >= 0, got {v!r}")
        return cls(**{k: (int(v) if k in ("distractors", "seed") else v) for k, v in values.items()})

    @property
    def active(self) -> bool:
        return self.lighting or self.textures or self.camera_jitter or self.distractors > 0


def _object_bodies(model: mujoco.MjModel) -> np.ndarray:
    """Bodies that are task objects: mocap bodies and bodies on a free joint, with their children."""
    free = {int(model.jnt_bodyid[j]) for j in range(model.njnt) if model.jnt_type[j] == mujoco.mjtJoint.mjJNT_FREE}
    roots = free | {b for b in range(model.nbody) if model.body_mocapid[b] >= 0}
    out = np.zeros(model.nbody, bool)
    for b in range(1, model.nbody):
        out[b] = b in roots or out[model.body_parentid[b]]
    return out


def _turn(quat: np.ndarray, angle: float, rng: np.random.Generator) -> np.ndarray:
    """``quat`` turned by ``angle`` about a random axis."""
    axis = rng.normal(size=3)
    small = np.zeros(4)
    mujoco.mju_axisAngle2Quat(small, axis / np.linalg.norm(axis), angle)
    out = np.zeros(4)
    mujoco.mju_mulQuat(out, quat, small)
    return out


class DomainRandomization(gymnasium.Wrapper):
    """Randomises the MuJoCo model of the wrapped task at every reset (see the module docstring).
    The env must keep its ``mujoco.MjModel`` / ``MjData`` in ``model`` / ``data``; textures and
    distractors also need an observation renderer (:data:`OBSERVATION_HOOKS`), and distractors the
    scene's ``distractor<i>`` geoms (the arm scenes)."""

    def __init__(self, env: gymnasium.Env, settings: RandomizeSettings | Mapping[str, Any]):
        super().__init__(env)
        self.settings = settings if isinstance(settings, RandomizeSettings) else RandomizeSettings.from_mapping(settings)
        base = env.unwrapped
        if not isinstance(getattr(base, "model", None), mujoco.MjModel):
            raise ValueError(f"randomize: {type(base).__name__} keeps no mujoco.MjModel in .model")
        m = self.model = base.model
        self._distractors = np.array([g for g in range(m.ngeom) if (m.geom(g).name or "").startswith("distractor")], int)
        if self.settings.distractors > len(self._distractors):
            raise ValueError(f"randomize.distractors: {type(base).__name__}'s scene has {len(self._distractors)} "
                             f"distractor geoms, {self.settings.distractors} asked for")
        self._observe = _observation_hook(base)
        late = [k for k in ("textures", "distractors") if getattr(self.settings, k)]
        if late and self._observe is None:
            raise ValueError(f"randomize.{late[0]}: {type(base).__name__} cannot render its observation again after "
                             f"the task's reset (none of {list(OBSERVATION_HOOKS)})")
        v = m.vis.headlight
        self._nominal = {"light_pos": m.light_pos.copy(), "light_dir": m.light_dir.copy(),
                         "light_diffuse": m.light_diffuse.copy(), "head_ambient": v.ambient.copy(),
                         "head_diffuse": v.diffuse.copy(), "cam_pos": m.cam_pos.copy(), "cam_quat": m.cam_quat.copy(),
                         "geom_rgba": m.geom_rgba.copy(), "geom_size": m.geom_size.copy()}
        scenery = ~_object_bodies(m)[m.geom_bodyid] & (m.geom_rgba[:, 3] > 0)
        scenery[self._distractors] = False
        self._scenery = np.flatnonzero(scenery)
        self._rng = np.random.default_rng(self.settings.seed)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if not self.settings.active:
            return self.env.reset(seed=seed, options=options)
        rng = self._rng if seed is None else np.random.default_rng([self.settings.seed, int(seed)])
        self._restore_colors()
        self._scene(rng)
        before = self.model.geom_rgba.copy()
        obs, info = self.env.reset(seed=seed, options=options)
        if self.settings.textures:
            untouched = self._scenery[np.all(self.model.geom_rgba[self._scenery] == before[self._scenery], axis=1)]
            self._textures(untouched, rng)
        self._place_distractors(rng)
        if self.settings.textures or self.settings.distractors:
            base = self.env.unwrapped
            mujoco.mj_kinematics(base.model, base.data)  # poses only: velocities, contacts and warm start stay
            mujoco.mj_camlight(base.model, base.data)
            obs = self._observe()
        return obs, info

    def _restore_colors(self) -> None:
        """Scenery colours back to nominal, so the task's reset is seen against them."""
        self.model.geom_rgba[self._scenery] = self._nominal["geom_rgba"][self._scenery]

    def _scene(self, rng: np.random.Generator) -> None:
        """Lights and cameras, drawn before the task's reset renders its first frame."""
        m, n, s = self.model, self._nominal, self.settings
        if s.lighting:
            k = m.nlight
            scale = rng.uniform(*LIGHT_SCALE, size=(k, 1)) * rng.uniform(0.9, 1.1, size=(k, 3))
            m.light_diffuse[:] = np.clip(n["light_diffuse"] * scale, 0.0, 1.0)
            m.light_pos[:] = n["light_pos"] + rng.uniform(-LIGHT_SHIFT, LIGHT_SHIFT, size=(k, 3))
            d = n["light_dir"] + rng.uniform(-LIGHT_TILT, LIGHT_TILT, size=(k, 3))
            m.light_dir[:] = d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-9)
            m.vis.headlight.ambient[:] = n["head_ambient"] * rng.uniform(*HEADLIGHT_SCALE)
            m.vis.headlight.diffuse[:] = n["head_diffuse"] * rng.uniform(*HEADLIGHT_SCALE)
        if s.camera_jitter:
            m.cam_pos[:] = n["cam_pos"] + rng.uniform(-CAMERA_SHIFT, CAMERA_SHIFT, size=n["cam_pos"].shape)
            for c in range(m.ncam):
                m.cam_quat[c] = _turn(n["cam_quat"][c], rng.uniform(0.0, CAMERA_TURN), rng)

    def _textures(self, geoms: np.ndarray, rng: np.random.Generator) -> None:
        mix = rng.uniform(0.0, TEXTURE_MIX, size=(len(geoms), 1))
        rgb = self._nominal["geom_rgba"][geoms, :3]
        self.model.geom_rgba[geoms, :3] = (1 - mix) * rgb + mix * rng.uniform(0.0, 1.0, size=(len(geoms), 3))

    def _place_distractors(self, rng: np.random.Generator) -> None:
        """Show ``distractors`` of the hidden geoms on the table, clear of the task's objects."""
        m, d = self.model, self.env.unwrapped.data
        m.geom_group[self._distractors] = HIDDEN_GROUP
        count = self.settings.distractors
        if not count:
            return
        own = set(m.geom_bodyid[self._distractors].tolist())
        objects = [d.xpos[b, :2].copy() for b in np.flatnonzero(_object_bodies(m)) if b not in own]
        placed: list[np.ndarray] = []
        r0, r1, a0, a1 = DISTRACTOR_REGION
        for g in rng.permutation(self._distractors)[:count]:
            for _ in range(100):
                r, a = rng.uniform(r0, r1), rng.uniform(a0, a1)
                xy = np.array([r * math.cos(a), r * math.sin(a)])
                if all(np.linalg.norm(xy - p) >= DISTRACTOR_CLEARANCE for p in objects + placed):
                    break
            else:
                continue  # no room left on this table: fewer distractors this episode
            placed.append(xy)
            size = self._nominal["geom_size"][g] * rng.uniform(0.8, 1.4)
            m.geom_size[g] = size
            d.mocap_pos[m.body_mocapid[m.geom_bodyid[g]]] = (xy[0], xy[1], _half_height(int(m.geom_type[g]), size))
            m.geom_rgba[g] = (*rng.uniform(0.0, 1.0, size=3), 1.0)
            m.geom_group[g] = 0


def _half_height(geom_type: int, size: np.ndarray) -> float:
    """Height of an upright geom's centre above the surface it stands on."""
    t = mujoco.mjtGeom
    if geom_type == t.mjGEOM_SPHERE:
        return float(size[0])
    if geom_type == t.mjGEOM_CAPSULE:
        return float(size[0] + size[1])
    if geom_type == t.mjGEOM_ELLIPSOID:
        return float(size[2])
    return float(size[1] if geom_type == t.mjGEOM_CYLINDER else size[2])
