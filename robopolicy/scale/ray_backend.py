"""Ray actors behind the same rollout interfaces as the local worker processes (``backend: ray``).

    ray: {address: null}          # null: a Ray started on this machine; "auto" or "ray://head:10001": a cluster

Each Ray call carries a whole episode, never one env step: a worker runs the policy, the chunk
executor and the env in its own process, and returns only the episode's results.

- :class:`RolloutWorker` is one actor: the policy, shipped once through Ray's object store when the
  actor starts (new weights pushed with :meth:`RolloutPool.push`), and the env it built last.
- :class:`RolloutPool` runs ``fn(worker, item)`` for a list of items on ``workers`` actors, each
  item on whichever actor is free, and gives the results in item order. An actor that dies is
  replaced by a new one (the policy and the last pushed weights again) and its item runs again
  from the start; ``stats`` counts both. An item's result reaches the caller once, from the run
  that finished.
- Evaluation (:func:`robopolicy.eval.rollout.episode_on_worker`): one item per episode seed.
- Refinement rollouts (DAgger, HG-DAgger): one item per env row, that row's whole rollout of an
  iteration; the pool lives across iterations and gets the fine-tuned weights before each.
- Collection: :func:`collect_on_ray` hands seeds to :class:`CollectActor` s (oracle episodes,
  staged under the dataset's staging folder); the driver alone commits them, so an episode is
  never written twice. On a cluster the dataset folder must be on storage every node sees.

Ray is an optional dependency (``pip install robopolicy[scale]``); nothing here imports it at
module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence


@dataclass
class RayConfig:
    """Where the Ray actors run (with ``backend: ray``)."""

    address: str | None = None
    """None: start Ray on this machine (``ray.init()``); ``auto``: the cluster this machine joined
    with ``ray start``; ``ray://<head>:10001``: a remote cluster through Ray Client."""
    num_cpus_per_worker: float = 1.0
    """CPUs each worker actor reserves (Ray schedules actors by it)."""


def require_ray():
    """The ``ray`` module, or an error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("backend=ray needs Ray: pip install 'robopolicy[scale]' (or pip install ray)") from None
    return ray


def fit_workers(cfg: RayConfig, workers: int, log: Callable[[str], None] = print) -> int:
    """``workers``, or on a Ray started here (``address`` None) as many as its CPUs hold at
    ``num_cpus_per_worker`` each: an actor that cannot be placed would wait forever with its work.
    On a cluster the request stands (an autoscaler may add nodes), with a warning when it does not fit."""
    ray = init_ray(cfg)
    cpus = float(ray.cluster_resources().get("CPU", 0.0))
    fits = max(1, int(cpus // cfg.num_cpus_per_worker)) if cfg.num_cpus_per_worker > 0 else workers
    if workers <= fits:
        return workers
    if cfg.address is None:
        log(f"[ray] {workers} workers at {cfg.num_cpus_per_worker:g} CPU each do not fit the {cpus:g} CPUs of the "
            f"local Ray: running {fits} (the episodes do not depend on the worker count)")
        return fits
    log(f"[ray] {workers} workers at {cfg.num_cpus_per_worker:g} CPU each need more than the cluster's {cpus:g} "
        f"CPUs now: the rest start when nodes join")
    return workers


def init_ray(cfg: RayConfig):
    """``ray.init`` once per process (local by default, ``cfg.address`` for a cluster); the module."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=cfg.address, include_dashboard=False)
    return ray


def _is_dead_actor(exc: BaseException) -> bool:
    """Whether ``exc`` says the actor's process is gone (not that the actor could not start: a
    worker that fails in its constructor would fail the same way again)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    if getattr(exc, "actor_init_failed", False):
        return False
    return isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError))


@dataclass
class PoolStats:
    """What a pool did beside its results: actors replaced after dying, items run again."""

    replaced: int = 0
    reruns: int = 0


def _drive(idle: list, make_actor: Callable[[], Any], call: Callable[[Any, Any], Any], items: Sequence[Any],
           on_result: Callable[[int, Any], None], stats: PoolStats, on_lost: Callable[[Any], None] | None = None,
           on_error: Callable[[Any, BaseException], None] | None = None, max_reruns: int = 3) -> list:
    """Run ``call(actor, item) -> ObjectRef`` for every item on the ``idle`` actors; ``on_result(i,
    value)`` as item ``i`` finishes. A dead actor is replaced by ``make_actor()`` and its item run
    again after ``on_lost(item)``; an item whose actors die more than ``max_reruns`` times raises.
    An item that raises goes to ``on_error(item, exc)`` when given, else raises here. Returns the
    actors (the replacements included); on an exception, the actors still running are killed."""
    ray = require_ray()
    todo = list(range(len(items)))[::-1]
    tries: dict[int, int] = {}
    running: dict[Any, tuple[Any, int]] = {}  # ObjectRef -> (actor, item index)
    try:
        while todo or running:
            while idle and todo:
                actor, i = idle.pop(), todo.pop()
                running[call(actor, items[i])] = (actor, i)
            done, _ = ray.wait(list(running), num_returns=1)
            actor, i = running.pop(done[0])
            try:
                value = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001
                if not _is_dead_actor(exc):
                    if on_error is None:
                        raise
                    idle.append(actor)
                    on_error(items[i], exc)
                    continue
                stats.replaced += 1
                stats.reruns += 1
                tries[i] = tries.get(i, 0) + 1
                if tries[i] > max_reruns:
                    raise RuntimeError(f"{items[i]!r}: its worker died {tries[i]} times") from exc
                if on_lost is not None:
                    on_lost(items[i])
                idle.append(make_actor())
                todo.append(i)
                continue
            idle.append(actor)
            on_result(i, value)
    except BaseException:
        for actor, _ in running.values():
            ray.kill(actor)
        raise
    return idle


def run_pool(make_actor: Callable[[], Any], call: Callable[[Any, Any], Any], items: Iterable[Any], workers: int,
             on_result: Callable[[Any, Any], None], on_lost: Callable[[Any], None] | None = None,
             on_error: Callable[[Any, BaseException], None] | None = None, max_reruns: int = 3) -> PoolStats:
    """Run ``call(actor, item) -> ObjectRef`` for every item on ``workers`` actors from ``make_actor``,
    made for this run and killed after it; ``on_result(item, value)`` as each finishes (in this
    process, one at a time). See :func:`_drive` for dead actors and failing items."""
    ray = require_ray()
    items = list(items)
    stats = PoolStats()
    idle = [make_actor() for _ in range(min(workers, len(items)))]
    try:
        idle = _drive(idle, make_actor, call, items, lambda i, value: on_result(items[i], value), stats,
                      on_lost, on_error, max_reruns)
    finally:
        for actor in idle:
            ray.kill(actor)
    return stats


# ---------------------------------------------------------------------------- policy rollouts


class RolloutWorker:
    """One rollout worker in a Ray actor: a policy (sent once, when the actor starts), weights
    pushed later, and one object kept between calls (the env it built last, :meth:`keep`)."""

    def __init__(self, policy: Any, threads: int = 1):
        import os

        os.environ.setdefault("MUJOCO_GL", "egl")
        import torch

        if threads > 0:
            torch.set_num_threads(threads)
        self.policy = policy
        self._kept: tuple[Any, Any] | None = None

    def set_weights(self, state: dict) -> None:
        """Load pushed weights into the policy (a ``state_dict``, tensors on the CPU)."""
        self.policy.load_state_dict(state)

    def keep(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``'s object for ``key`` (compared with ``==``), built on first use and kept for the
        next call with the same key; an object kept for another key is closed first."""
        if self._kept is not None and self._kept[0] == key:
            return self._kept[1]
        self.close()
        self._kept = (key, make())
        return self._kept[1]

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(self, *args)`` (``fn`` an importable function: it travels by name)."""
        return fn(self, *args)

    def close(self) -> None:
        if self._kept is not None and hasattr(self._kept[1], "close"):
            self._kept[1].close()
        self._kept = None


def _on_cpu(policy: Any) -> Any:
    """``policy``, or a CPU copy of it when its weights are on an accelerator (the workers reserve CPUs only)."""
    params = getattr(policy, "parameters", None)
    if callable(params) and any(p.device.type != "cpu" for p in params()):
        import copy

        return copy.deepcopy(policy).to("cpu")
    return policy


class RolloutPool:
    """``workers`` :class:`RolloutWorker` actors, each holding ``policy`` (pickled once into Ray's
    object store, unpickled once per actor). ``map(fn, items)`` runs ``fn(worker, item)`` for every
    item and returns the results in item order; ``push(policy)`` sends new weights to every actor
    (and to any that replaces a dead one). ``stats``: actors replaced and items run again so far.

    Use as a context manager, or call :meth:`close`."""

    def __init__(self, policy: Any, workers: int, ray_cfg: RayConfig | None = None, threads: int = 1):
        self.ray_cfg = ray_cfg or RayConfig()
        self.ray = init_ray(self.ray_cfg)
        self._remote = self.ray.remote(num_cpus=self.ray_cfg.num_cpus_per_worker, max_restarts=0)(RolloutWorker)
        self._policy = self.ray.put(_on_cpu(policy))
        self._weights = None
        self.threads = int(threads)
        self.stats = PoolStats()
        self._idle = [self._new() for _ in range(fit_workers(self.ray_cfg, max(1, int(workers))))]

    @property
    def size(self) -> int:
        """Actors in the pool (between :meth:`map` calls)."""
        return len(self._idle)

    def _new(self):
        actor = self._remote.remote(self._policy, self.threads)
        if self._weights is not None:
            actor.set_weights.remote(self._weights)  # an actor runs its calls in order
        return actor

    def push(self, policy: Any) -> None:
        """Send ``policy``'s current weights to every actor (before the next :meth:`map`)."""
        state = {k: v.detach().cpu() for k, v in policy.state_dict().items()}
        self._weights = self.ray.put(state)
        pending = [(a, a.set_weights.remote(self._weights)) for a in self._idle]
        for i, (actor, ref) in enumerate(pending):
            try:
                self.ray.get(ref)
            except Exception as exc:  # noqa: BLE001
                if not _is_dead_actor(exc):
                    raise
                self._idle[i] = self._new()
                self.stats.replaced += 1

    def map(self, fn: Callable[..., Any], items: Sequence[Any], on_result: Callable[[int, Any], None] | None = None,
            max_reruns: int = 3) -> list:
        """``[fn(worker, item) for item in items]``, run on the actors; ``on_result(i, value)`` as item
        ``i`` finishes. A dead actor's item runs again on a new actor (counted in ``stats``)."""
        items = list(items)
        results: list = [None] * len(items)

        def done(i: int, value: Any) -> None:
            results[i] = value
            if on_result is not None:
                on_result(i, value)

        # _drive works on self._idle in place: after an error it still holds the actors left idle
        _drive(self._idle, self._new, lambda actor, item: actor.run.remote(fn, item), items, done, self.stats,
               max_reruns=max_reruns)
        return results

    def close(self) -> None:
        for actor in self._idle:
            try:
                self.ray.get(actor.close.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - closing what may have died
                pass
            self.ray.kill(actor)
        self._idle = []

    def __enter__(self) -> "RolloutPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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

    return run_pool(lambda: remote.remote(*args), lambda actor, seed: actor.stage.remote(seed), seeds,
                    fit_workers(ray_cfg, workers),
                    lambda seed, staged: on_result(staged), on_lost=lost,
                    on_error=lambda seed, exc: errors.append(f"seed {seed}: {exc}"))
