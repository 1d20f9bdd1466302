"""The envs rollouts run: task + follower + task wrappers + mapping + episode bookkeeping, and
the one vector-env factory (:func:`make_vector_env`) that evaluation and refinement share.

No torch here: :func:`make_eval_env` and :func:`make_task_env` are what each worker process of a
vector env unpickles.

Wrapper stack, inside out::

    task env ─► WaypointFollowWrapper (waypoint policies) ─► task wrappers (reward mode,
    privileged state, oracle labels: ``sim_envs.wrappers``) ─► MappedEnv (LeRobot keys, action
    scale) ─► EvalEpisode (episode summary in info, MP4 of chosen seeds, parks when done)
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import gymnasium
import numpy as np
from gymnasium import spaces

from robopolicy.envs import EnvConfig, make_env
from robopolicy.eval.config import EnvMapping
from sim_envs.wrappers import wrap_task

EPISODE_INFO = "eval_episode"
"""Info key holding the finished episode's summary (a JSON string) on its last step."""
SUCCESS_KEYS = ("is_success", "success")
"""Info keys an env reports success under (gymnasium's convention, then Meta-World's)."""
SUCCESS_RULES = ("auto", "final", "any")


def success_flag(info: dict) -> tuple[str | None, bool]:
    """``(key, value)`` of the first :data:`SUCCESS_KEYS` entry in a step's ``info``; ``(None, False)``
    when the env reports neither."""
    for key in SUCCESS_KEYS:
        if key in info:
            return key, bool(info[key])
    return None, False


def _to_uint8_image(value: np.ndarray) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == np.uint8:
        return arr
    return np.clip(np.asarray(arr, dtype=np.float32) * 255.0 + 0.5, 0, 255).astype(np.uint8)


class MappedEnv(gymnasium.Wrapper):
    """Present any env with LeRobot observation keys and policy-unit actions.

    Observation: ``{"observation.images.<cam>": uint8 (H, W, 3), "observation.state": (D,),
    "task": str}``. Action: the policy's, turned into the env's by ``* scale + offset``.
    """

    def __init__(self, env: gymnasium.Env, mapping: EnvMapping):
        super().__init__(env)
        self.mapping = mapping
        inner = env.observation_space
        table = dict(mapping.observation)
        if not table:
            if isinstance(inner, spaces.Dict):
                table = {k: k for k in inner.spaces if k != "task"}
                foreign = [k for k in table if not k.startswith("observation.")]
                if foreign:
                    raise ValueError(f"env observation keys {foreign} are not LeRobot keys: map them with "
                                     f"mapping.observation (e.g. {{observation.images.front: {foreign[0]}}})")
            else:
                table = {"observation.state": "."}
        self._table = {k: v for k, v in table.items() if k != "task"}
        self._task_key = table.get("task", "task")
        out: dict[str, spaces.Space] = {}
        for key, src in self._table.items():
            space = self._source_space(inner, src, key)
            if key.startswith("observation.images."):
                if len(space.shape) != 3 or space.shape[-1] != 3:
                    raise ValueError(f"mapping: {key!r} <- {src!r} must be an (H, W, 3) image, got {space.shape}")
                out[key] = spaces.Box(0, 255, space.shape, np.uint8)
            else:
                out[key] = spaces.Box(-np.inf, np.inf, space.shape, np.float32)
        out["task"] = spaces.Text(max_length=512, min_length=0, charset=_TEXT_CHARSET)
        self.observation_space = spaces.Dict(out)

        base = env.action_space
        if not isinstance(base, spaces.Box):
            raise ValueError(f"evaluation needs a Box action space, got {base}")
        dim = base.shape
        self._scale = self._broadcast(mapping.action_scale, dim, 1.0, "action_scale")
        self._offset = self._broadcast(mapping.action_offset, dim, 0.0, "action_offset")
        self._identity = mapping.action_scale is None and mapping.action_offset is None
        self.action_space = base if self._identity else spaces.Box(-np.inf, np.inf, dim, np.float32)

    @staticmethod
    def _source_space(inner: spaces.Space, src: str, key: str) -> spaces.Space:
        if src == ".":
            return inner
        if not isinstance(inner, spaces.Dict) or src not in inner.spaces:
            have = list(inner.spaces) if isinstance(inner, spaces.Dict) else ["."]
            raise ValueError(f"mapping: {key!r} reads env observation key {src!r}, which the env does not have "
                             f"(it has: {have})")
        return inner.spaces[src]

    @staticmethod
    def _broadcast(values, shape, default, name) -> np.ndarray:
        if values is None:
            return np.full(shape, default, np.float32)
        arr = np.asarray(values, np.float32)
        if arr.size not in (1, int(np.prod(shape))):
            raise ValueError(f"mapping.{name} needs 1 or {int(np.prod(shape))} values, got {arr.size}")
        return np.broadcast_to(arr.reshape(-1) if arr.size == 1 else arr.reshape(shape), shape).astype(np.float32)

    def _map(self, obs: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, src in self._table.items():
            value = obs if src == "." else obs[src]
            out[key] = _to_uint8_image(value) if key.startswith("observation.images.") else np.asarray(value, np.float32)
        if self.mapping.task is not None:
            out["task"] = self.mapping.task
        else:
            out["task"] = str(obs.get(self._task_key, "")) if isinstance(obs, dict) else ""
        return out

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self._map(obs), info

    def step(self, action):
        if not self._identity:
            action = np.asarray(action, np.float32) * self._scale + self._offset
        obs, reward, terminated, truncated, info = self.env.step(action)
        return self._map(obs), reward, terminated, truncated, info


# Printable ASCII plus common accents: instructions of any task fit.
_TEXT_CHARSET = "".join(chr(c) for c in range(32, 127)) + "àâäçéèêëîïôöùûüÀÉÈ’"


class EvalEpisode(gymnasium.Wrapper):
    """One evaluation episode per reset: its summary arrives in ``info[EPISODE_INFO]``.

    The end of an episode is reported in ``info`` (a JSON string with seed, steps, success,
    return, task and the env's ``episode_metrics``), never through terminated/truncated, which
    stay False: the vector env then never auto-resets, and the evaluation loop decides which
    seed each env runs next. After its end the env is parked: steps return the last observation
    without touching the task. Episodes whose seed is in ``videos`` are rendered to that MP4.

    Success: the last step's ``info["is_success"]`` (an env that reports it on every step, such as
    PersonFollow, is judged on the state it ends in); for an env that reports only
    ``info["success"]`` (Meta-World's convention, where an episode need not end on success), any
    step's. ``success_rule`` ``final`` / ``any`` forces one reading. The summary's
    ``success_reported`` is False when no step reported either key.
    """

    def __init__(self, env: gymnasium.Env, videos: dict[int, str] | None = None, max_steps: int | None = None,
                 success_rule: str = "auto"):
        super().__init__(env)
        if success_rule not in SUCCESS_RULES:
            raise ValueError(f"success_rule must be one of {SUCCESS_RULES}, got {success_rule!r}")
        self.videos = dict(videos or {})
        self.max_steps = max_steps
        self.success_rule = success_rule
        self._done = True
        self._last_obs: Any = None
        self._frames: list[np.ndarray] | None = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options or None)
        self._seed, self._steps, self._return, self._done = seed, 0, 0.0, False
        self._success_key: str | None = None
        self._ever_succeeded = False
        self._task = str(obs.get("task", "")) if isinstance(obs, dict) else ""
        self._last_obs = obs
        self._frames = [self.env.render()] if seed in self.videos else None
        return obs, {}

    def step(self, action):
        if self._done:
            return self._last_obs, 0.0, False, False, {}
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._steps += 1
        self._return += float(reward)
        self._last_obs = obs
        if self._frames is not None:
            self._frames.append(self.env.render())
        key, flag = success_flag(info)
        if key is not None:
            self._success_key, self._ever_succeeded = key, self._ever_succeeded or flag
        if self.max_steps is not None and self._steps >= self.max_steps and not (terminated or truncated):
            truncated = True
            now = getattr(self.env.unwrapped, "episode_metrics_now", None)
            if now is not None:
                info = dict(info, episode_metrics=now(info))
        if not (terminated or truncated):
            return obs, reward, False, False, {}
        self._done = True
        rule = self.success_rule
        if rule == "auto":
            rule = "any" if self._success_key == "success" else "final"
        summary = {
            "seed": self._seed,
            "steps": self._steps,
            "success": self._ever_succeeded if rule == "any" else flag,
            "success_reported": self._success_key is not None,
            "return": self._return,
            "task": self._task,
            "terminated": bool(terminated),
            "episode_metrics": info.get("episode_metrics", {}),
        }
        if self._frames is not None:
            from robopolicy.utils.video import write_mp4

            fps = float(self.env.metadata.get("render_fps", 10))
            summary["video"] = str(write_mp4(self.videos[self._seed], self._frames, fps))
            self._frames = None
        return obs, reward, False, False, {EPISODE_INFO: json.dumps(summary, default=_json_default)}


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


class OracleDrives(gymnasium.Wrapper):
    """The task's privileged oracle chooses every action; the action given to :meth:`step` is
    ignored (``robopolicy eval --checkpoint oracle``, :mod:`robopolicy.eval.oracle_policy`)."""

    def __init__(self, env: gymnasium.Env):
        super().__init__(env)
        from sim_envs import make_oracle

        self.oracle = make_oracle(env, noise=0.0)
        self._last: tuple[Any, dict] = ({}, {})

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.oracle.reset(obs, info)
        self._last = (obs, info)
        return obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(self.oracle.act(*self._last).action)
        self._last = (obs, info)
        return obs, reward, terminated, truncated, info


@dataclass
class EvalEnvSpec:
    """Everything a worker process needs to build one evaluation env (picklable)."""

    env: EnvConfig
    mapping: EnvMapping | None = field(default_factory=EnvMapping)
    """``None``: the task's own observation and action (refinement's evaluations)."""
    waypoints: int | None = None
    """K of a waypoint policy: wrap the task in ``WaypointFollowWrapper``; ``None``: act directly."""
    videos: dict[int, str] = field(default_factory=dict)
    max_steps: int | None = None
    task: dict[str, Any] | None = None
    """Task wrapper settings (:func:`sim_envs.wrappers.wrap_task`); ``None``: none."""
    success_rule: str = "auto"
    render_mode: str | None = "rgb_array"
    oracle: bool = False
    """The task's oracle acts (:class:`OracleDrives`) and the policy's actions are ignored."""


def make_task_env(env: EnvConfig, waypoints: int | None = None, render_mode: str | None = None, wrap: bool = True,
                  **task: Any) -> gymnasium.Env:
    """One task env: the registered env, through a waypoint follower when ``waypoints`` is K, and
    (``wrap``) the task wrappers of ``task`` (reward, privileged, oracle, ...; see
    :func:`sim_envs.wrappers.wrap_task`)."""
    inner = make_env(env, render_mode=render_mode)
    if waypoints is not None:
        from sim_envs.person_follow.waypoints import WaypointFollowWrapper

        inner = WaypointFollowWrapper(inner, num_waypoints=int(waypoints))
    return wrap_task(inner, **task) if wrap else inner


def make_eval_env(spec: EvalEnvSpec) -> gymnasium.Env:
    """Build the wrapped evaluation env for ``spec`` (see the module docstring)."""
    env = make_task_env(spec.env, spec.waypoints, spec.render_mode, wrap=spec.task is not None, **(spec.task or {}))
    if spec.oracle:
        env = OracleDrives(env)
    if spec.mapping is not None:
        env = MappedEnv(env, spec.mapping)
    return EvalEpisode(env, videos=spec.videos, max_steps=spec.max_steps, success_rule=spec.success_rule)


def make_vector_env(make_one: Callable[[], gymnasium.Env], num_envs: int, autoreset: bool = False,
                    copy: bool = True) -> gymnasium.vector.VectorEnv:
    """``num_envs`` envs from ``make_one`` (a picklable callable): in this process for one, else in
    worker processes started with ``spawn`` and no shared memory (text observations break with
    shared memory, and a forked child hangs creating its EGL context). ``autoreset``: gymnasium's
    same-step autoreset (the observation returned with ``done`` is the next episode's first);
    otherwise none, and the caller resets finished envs with the seeds it wants."""
    fns = [make_one for _ in range(num_envs)]
    mode = gymnasium.vector.AutoresetMode.SAME_STEP if autoreset else gymnasium.vector.AutoresetMode.DISABLED
    if num_envs == 1:
        return gymnasium.vector.SyncVectorEnv(fns, autoreset_mode=mode, copy=copy)
    return gymnasium.vector.AsyncVectorEnv(fns, context="spawn", shared_memory=False, autoreset_mode=mode, copy=copy)


def make_eval_vector_env(spec: EvalEnvSpec, num_envs: int) -> gymnasium.vector.VectorEnv:
    """``num_envs`` evaluation envs; :class:`EvalEpisode` reports episode ends in ``info``, and
    the evaluation resets each env itself with the seed it wants."""
    return make_vector_env(partial(make_eval_env, spec), num_envs, autoreset=False, copy=False)


def make_task_envs(env: EnvConfig, num_envs: int, autoreset: bool = True, **kwargs: Any) -> gymnasium.vector.VectorEnv:
    """``num_envs`` copies of :func:`make_task_env` (rollout envs of the refinement loops)."""
    return make_vector_env(partial(make_task_env, env, **kwargs), num_envs, autoreset=autoreset)


def single_spaces(env: EnvConfig, **kwargs: Any) -> tuple[gymnasium.spaces.Dict, gymnasium.spaces.Box]:
    """Observation and action space of one task env (built once in this process, then closed)."""
    e = make_task_env(env, **kwargs)
    try:
        return e.observation_space, e.action_space
    finally:
        e.close()


def step_while(envs: gymnasium.vector.VectorEnv, action: np.ndarray, work: Callable[[], None]):
    """``envs.step(action)`` with ``work()`` run while the workers step (spawned workers), or just
    before the step (one env in this process): the learner's updates overlap the simulation. Either
    way ``work`` sees the state before the step's results, so spawned and in-process envs give the
    same sequence of updates."""
    if isinstance(envs, gymnasium.vector.AsyncVectorEnv):
        envs.step_async(action)
        work()
        return envs.step_wait()
    work()
    return envs.step(action)


def accepts_kwarg(env_id: str, name: str) -> bool:
    """Whether the env registered as ``env_id`` takes constructor argument ``name`` (its spec's
    kwargs name it, or its entry point's signature names it, through ``**kwargs`` passed to a base)."""
    try:
        spec = gymnasium.spec(env_id)
    except gymnasium.error.Error:
        return False
    if name in (spec.kwargs or {}):
        return True
    entry = spec.entry_point
    if isinstance(entry, str):
        try:
            from gymnasium.envs.registration import load_env_creator

            entry = load_env_creator(entry)
        except (ImportError, AttributeError, ValueError):
            return False
    # a class whose __init__ passes **kwargs on is asked again through its bases' __init__
    for owner in (entry.__mro__ if isinstance(entry, type) else (entry,)):
        try:
            params = inspect.signature(owner.__init__ if isinstance(owner, type) else owner).parameters
        except (TypeError, ValueError):
            return False
        if name in params:
            return True
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return False
    return False
