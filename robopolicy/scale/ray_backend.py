"""Ray actors behind the same rollout interfaces as the local worker processes (``backend: ray``).

    ray: {address: null}          # null: a Ray started on this machine; "auto" or "ray://head:10001": a cluster

- Evaluation: :class:`RayVectorEnv` is a gymnasium vector env whose rows are Ray actors, each
  holding one env. The evaluation loop (:func:`robopolicy.eval.episodes.run_episodes`) and the
  batched policy stay in this process, so the same seeds give the same episodes as the local
  ``AsyncVectorEnv``. An actor that dies is replaced by a fresh one; the step reports the row in
  ``infos["_rerun"]`` and the loop runs that row's episode again from its seed.
- Collection: :func:`run_pool` hands whole episodes (one seed each) to a pool of actors and
  replaces an actor that dies, its episode handed to the new one. The actors stage episodes under
  the dataset's staging folder and the driver alone commits them, so an episode is never written
  twice; on a cluster the dataset folder must be on storage every node sees.

Ray is an optional dependency (``pip install robopolicy[scale]``); nothing here imports it at
module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import gymnasium
import numpy as np
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array, iterate

RERUN_INFO = "_rerun"
"""Vector-env info key: a ``(W,)`` bool mask of the rows whose env was replaced during the step."""


@dataclass
class RayConfig:
    """Where the Ray actors run (with ``backend: ray``)."""

    address: str | None = None
    """None: start Ray on this machine (``ray.init()``); ``auto``: the cluster this machine joined
    with ``ray start``; ``ray://<head>:10001``: a remote cluster through Ray Client."""
    num_cpus_per_worker: float = 1.0
    """CPUs each env actor reserves (Ray schedules actors by it)."""


def require_ray():
    """The ``ray`` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend=ray needs Ray: pip install 'robopolicy[scale]' (or pip install ray)") from None
    return ray


def init_ray(cfg: RayConfig):
    """``ray.init`` once per process (local by default, ``cfg.address`` for a cluster); the module."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=cfg.address, include_dashboard=False)
    return ray


def _is_dead_actor(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


class EnvActor:
    """One env in a Ray actor: reset and step answer exactly as the env does (made by ``make_one``)."""

    def __init__(self, make_one: Callable[[], gymnasium.Env]):
        import os

        os.environ.setdefault("MUJOCO_GL", "egl")
        self.env = make_one()

    def spaces(self) -> tuple[Any, Any, dict]:
        return self.env.observation_space, self.env.action_space, dict(self.env.metadata)

    def reset(self, seed: int | None, options: dict | None):
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        return self.env.step(action)

    def pid(self) -> int:
        import os

        return os.getpid()

    def close(self) -> None:
        self.env.close()


class RayVectorEnv(gymnasium.vector.VectorEnv):
    """``num_envs`` envs from ``make_one`` (a picklable callable), each in a Ray actor; no autoreset
    (the caller resets finished rows with the seeds it wants, as the evaluation does).

    A row whose actor dies during ``reset`` or ``step`` gets a new actor, reset with the seed that
    row last started from; the step returns its fresh first observation and flags the row in
    ``infos["_rerun"]`` (:data:`RERUN_INFO`). ``replaced`` counts the actors replaced so far.
    """

    def __init__(self, make_one: Callable[[], gymnasium.Env], num_envs: int, ray_cfg: RayConfig | None = None):
        self.ray = init_ray(ray_cfg or RayConfig())
        self.ray_cfg = ray_cfg or RayConfig()
        self.make_one, self.num_envs = make_one, int(num_envs)
        self._remote = self.ray.remote(num_cpus=self.ray_cfg.num_cpus_per_worker, max_restarts=0)(EnvActor)
        self.actors = [self._remote.remote(make_one) for _ in range(self.num_envs)]
        obs_space, act_space, metadata = self.ray.get(self.actors[0].spaces.remote())
        self.single_observation_space, self.single_action_space = obs_space, act_space
        self.observation_space = batch_space(obs_space, self.num_envs)
        self.action_space = batch_space(act_space, self.num_envs)
        self.metadata = {**metadata, "autoreset_mode": gymnasium.vector.AutoresetMode.DISABLED}
        self._obs = [None] * self.num_envs
        self._seeds: list[int | None] = [None] * self.num_envs
        self._buffer = create_empty_array(obs_space, n=self.num_envs, fn=np.zeros)
        self.replaced = 0

    # ------------------------------------------------------------------ rows
    def _replace(self, row: int) -> None:
        try:
            self.ray.kill(self.actors[row], no_restart=True)
        except Exception:  # noqa: BLE001 - it is gone already
            pass
        self.actors[row] = self._remote.remote(self.make_one)
        self.replaced += 1

    def _restart(self, row: int, options: dict | None) -> tuple[Any, dict]:
        """A new actor for ``row``, reset with the row's seed (retried while actors keep dying)."""
        while True:
            self._replace(row)
            try:
                return self.ray.get(self.actors[row].reset.remote(self._seeds[row], options))
            except Exception as exc:  # noqa: BLE001
                if not _is_dead_actor(exc):
                    raise

    def _batch(self) -> Any:
        self._buffer = concatenate(self.single_observation_space, self._obs, self._buffer)
        return self._buffer

    # ------------------------------------------------------------------ gymnasium
    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict | None = None):
        options = dict(options or {})
        mask = options.pop("reset_mask", None)
        rows = range(self.num_envs) if mask is None else [int(r) for r in np.flatnonzero(mask)]
        if seed is None or isinstance(seed, int):
            seed = [None if seed is None else seed + i for i in range(self.num_envs)]
        futures = {}
        for r in rows:
            self._seeds[r] = seed[r]
            futures[r] = self.actors[r].reset.remote(seed[r], options or None)
        infos: dict = {}
        for r, fut in futures.items():
            try:
                self._obs[r], info = self.ray.get(fut)
            except Exception as exc:  # noqa: BLE001
                if not _is_dead_actor(exc):
                    raise
                self._obs[r], info = self._restart(r, options or None)
            infos = self._add_info(infos, info, r)
        return self._batch(), infos

    def step(self, actions):
        futures = [actor.step.remote(a) for actor, a in zip(self.actors, iterate(self.action_space, actions))]
        rewards = np.zeros(self.num_envs)
        terminated = np.zeros(self.num_envs, dtype=bool)
        truncated = np.zeros(self.num_envs, dtype=bool)
        rerun = np.zeros(self.num_envs, dtype=bool)
        infos: dict = {}
        try:  # one wait for all rows; row by row only when one of them failed
            results = self.ray.get(futures)
        except Exception:  # noqa: BLE001
            results = None
        for r, fut in enumerate(futures):
            try:
                out = results[r] if results is not None else self.ray.get(fut)
                self._obs[r], rewards[r], terminated[r], truncated[r], info = out
            except Exception as exc:  # noqa: BLE001
                if not _is_dead_actor(exc):
                    raise
                self._obs[r], _ = self._restart(r, None)
                rerun[r], info = True, {}
            infos = self._add_info(infos, info, r)
        if rerun.any():
            infos[RERUN_INFO] = rerun
        return self._batch(), rewards, terminated, truncated, infos

    def close_extras(self, **kwargs) -> None:
        for actor in self.actors:
            try:
                self.ray.get(actor.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - closing what may have died
                pass
            self.ray.kill(actor)
        self.actors = []


# ---------------------------------------------------------------------------- whole-episode pools


@dataclass
class PoolStats:
    """What a pool run did beside its results: actors replaced after dying, items run again."""

    replaced: int = 0
    reruns: int = 0


def run_pool(make_actor: Callable[[], Any], call: Callable[[Any, Any], Any], items: Iterable[Any], workers: int,
             on_result: Callable[[Any, Any], None], on_lost: Callable[[Any], None] | None = None,
             on_error: Callable[[Any, BaseException], None] | None = None, max_reruns: int = 3) -> PoolStats:
    """Run ``call(actor, item) -> ObjectRef`` for every item on ``workers`` actors from ``make_actor``;
    ``on_result(item, value)`` as each finishes (in this process, one at a time). An actor that
    dies is replaced and its item run again on the new one, after ``on_lost(item)`` (clean up what
    the dead actor left); an item whose actors die more than ``max_reruns`` times raises. An item
    that fails by raising goes to ``on_error(item, exc)`` when given (else it raises here)."""
    ray = require_ray()
    todo = list(items)[::-1]
    stats = PoolStats()
    tries: dict[Any, int] = {}
    running: dict[Any, tuple[Any, Any]] = {}  # ObjectRef -> (actor, item)
    idle = [make_actor() for _ in range(min(workers, len(todo)))]
    try:
        while todo or running:
            while idle and todo:
                actor, item = idle.pop(), todo.pop()
                running[call(actor, item)] = (actor, item)
            done, _ = ray.wait(list(running), num_returns=1)
            actor, item = running.pop(done[0])
            try:
                value = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001
                if not _is_dead_actor(exc):
                    if on_error is None:
                        raise
                    idle.append(actor)
                    on_error(item, exc)
                    continue
                stats.replaced += 1
                stats.reruns += 1
                tries[item] = tries.get(item, 0) + 1
                if tries[item] > max_reruns:
                    raise RuntimeError(f"{item!r}: its worker died {tries[item]} times") from exc
                if on_lost is not None:
                    on_lost(item)
                idle.append(make_actor())
                todo.append(item)
                continue
            idle.append(actor)
            on_result(item, value)
    finally:
        for actor in idle + [a for a, _ in running.values()]:
            ray.kill(actor)
    return stats


# ---------------------------------------------------------------------------- collection


class CollectActor:
    """A collection worker in a Ray actor: one env, whole oracle (or posed) episodes staged under
    the dataset's staging folder; the driver commits them (:func:`collect_on_ray`)."""

    TAG = "ray"

    def __init__(self, env: dict, root: str, features: dict, fps: int, noise: float, vcodec: str,
                 robot_type: str | None, posed: Any):
        import os

        os.environ.setdefault("MUJOCO_GL", "egl")
        from robopolicy.data.collect import quiet_encoders
        from robopolicy.envs import EnvConfig, make_env

        quiet_encoders()
        self.args = (root, features, fps, noise, vcodec, robot_type, posed)
        self.env = make_env(EnvConfig(**env), render_mode=None)

    def stage(self, seed: int) -> dict:
        from pathlib import Path

        from robopolicy.data.collect import _stage_one

        root, features, fps, noise, vcodec, robot_type, posed = self.args
        return _stage_one(self.env, Path(root), features, fps, seed, noise, vcodec, robot_type, self.TAG, posed=posed)


def collect_on_ray(ray_cfg: RayConfig, workers: int, env: dict, root, features: dict, fps: int, noise: float,
                   vcodec: str, robot_type: str | None, seeds: Sequence[int], on_result: Callable[[dict], None],
                   errors: list[str], posed: Any = None) -> PoolStats:
    """Stage one episode per seed on ``workers`` Ray actors; ``on_result(staged)`` commits each in
    this process. What a dead actor left half-staged is removed before its seed runs again; an
    episode that fails goes to ``errors`` (as the local workers report it)."""
    import shutil
    from pathlib import Path

    from robopolicy.data.recorder import STAGING_DIR

    ray = init_ray(ray_cfg)
    remote = ray.remote(num_cpus=ray_cfg.num_cpus_per_worker, max_restarts=0)(CollectActor)
    args = (env, str(root), features, fps, noise, vcodec, robot_type, posed)

    def lost(seed: int) -> None:
        for leftover in (Path(root) / STAGING_DIR).glob(f"{CollectActor.TAG}-seed{seed}-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    return run_pool(lambda: remote.remote(*args), lambda actor, seed: actor.stage.remote(seed), seeds, workers,
                    lambda seed, staged: on_result(staged), on_lost=lost,
                    on_error=lambda seed, exc: errors.append(f"seed {seed}: {exc}"))
