"""Vectorized policy rollouts: every split, the same seeds, metrics, JSON, table and videos.

    from robopolicy.eval import EvalConfig, evaluate
    report = evaluate(policy, EvalConfig(env=EnvConfig("robopolicy/PersonFollow-v0"), episodes=50, workers=2))
    print(report.table())

One split: episode i has seed ``cfg.seed + i``, whatever the worker count, run by the one
evaluation loop (:func:`robopolicy.eval.episodes.run_episodes`); the policy's chunks go through the
chunk executor (:class:`hardware.control.chunking.ChunkExecutor`). Constructor arguments the
evaluation adds (``image_size``, ``render_size``, ``use_cameras``, ``env_state``) are passed only
to an env whose constructor takes them, so any gymnasium env can be evaluated.

With ``backend: ray`` each Ray worker holds a copy of the policy and runs whole episodes
(:func:`episode_on_worker`: the policy, its own chunk executor and one env), one seed per call, as
one row of the local vector env runs them; only the episode summaries come back. A worker that
dies is replaced and its episode runs again from its seed (counted in ``reruns``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hardware.control.chunking import ChunkExecutor
from robopolicy.config import ConfigError
from robopolicy.envs import EnvConfig, resolve_env_id
from robopolicy.eval.config import EvalConfig
from robopolicy.eval.envs import EvalEnvSpec, accepts_kwarg, make_eval_vector_env
from robopolicy.eval.episodes import run_episodes, unreported_success
from robopolicy.eval.policy_runner import PolicyActor, PolicyRunner
from robopolicy.eval.report import EvalReport, SplitResult, summarize_split
from robopolicy.utils.records import write_summary


def waypoint_count(policy: Any, default: int = 8) -> int:
    """K of a waypoint policy (its ``horizon``, ``num_waypoints`` or its config's), else ``default``."""
    if getattr(policy, "output", None) == "waypoints" and isinstance(getattr(policy, "horizon", None), int):
        return int(policy.horizon)
    for owner in (policy, getattr(policy, "config", None), getattr(getattr(policy, "config", None), "head", None)):
        k = getattr(owner, "num_waypoints", None)
        if k:
            return int(k)
    return default


def trained_image_size(policy: Any) -> int | None:
    """The camera size the policy was trained on, when its config records one (square frames)."""
    frame = getattr(getattr(policy, "config", None), "frame_size", None)
    if frame and len(frame) == 2 and frame[0] == frame[1]:
        return int(frame[0])
    for owner in (policy, getattr(policy, "config", None)):
        size = getattr(owner, "image_size", None)
        if isinstance(size, int):
            return size
    return None


def observation_needs(policy: Any) -> tuple[bool, bool]:
    """(reads cameras, reads ``observation.environment_state``) for a :class:`Policy` or a
    residual over one (its base's needs, plus its own ``environment_state`` input)."""
    base = getattr(policy, "base", None)
    inputs = list(getattr(getattr(policy, "config", None), "inputs", None) or [])
    if base is not None or inputs:  # a residual / actor-critic checkpoint
        cams, scene = observation_needs(base) if base is not None else (False, False)
        return cams, scene or "environment_state" in inputs
    cfg = getattr(policy, "config", None)
    cams = getattr(cfg, "cameras", None)
    return (True if cams is None else bool(cams)), int(getattr(cfg, "env_state_dim", 0) or 0) > 0


def split_env_config(cfg: EvalConfig, split: str | None, policy: Any) -> EnvConfig:
    """The env config of one split, with image and render sizes applied where the env's
    constructor takes them; a task that can drop its cameras (``use_cameras``) is made without
    them for a state-based policy, and one that can observe its scene state (``env_state``) with
    it for a policy that reads it."""
    kwargs = dict(cfg.env.kwargs)
    if split is not None:
        kwargs["split"] = split
    env_id = resolve_env_id(cfg.env.id)

    def offer(name: str, value: Any) -> None:
        if value is not None and accepts_kwarg(env_id, name):
            kwargs.setdefault(name, value)

    cams, scene = observation_needs(policy)
    offer("use_cameras", None if cams else False)
    offer("camera", None if cams else False)  # PersonFollow's name for it
    offer("env_state", True if scene else None)
    image_size = cfg.image_size if cfg.image_size is not None else trained_image_size(policy)
    offer("image_size", None if image_size is None else int(image_size))
    offer("render_size", None if cfg.render_size is None else int(cfg.render_size))
    if cfg.instruction == "swap":
        if not accepts_kwarg(env_id, "instruction"):
            raise ConfigError(f"instruction=swap needs an env that can re-target by instruction (an 'instruction' "
                              f"argument, as robopolicy/PersonFollow-v0 has); {env_id} has none")
        kwargs["instruction"] = "swap"
    return EnvConfig(id=cfg.env.id, kwargs=kwargs)


def _follower_waypoints(cfg: EvalConfig, runner: PolicyRunner) -> int | None:
    follower = cfg.mapping.follower
    if follower == "none":
        if runner.kind == "waypoints":
            raise ConfigError("mapping.follower=none but the policy predicts waypoints: it needs follower=waypoints "
                              "(or auto) to drive a (v, omega) env")
        return None
    if follower == "waypoints" and runner.kind != "waypoints":
        raise ConfigError("mapping.follower=waypoints but the policy predicts action chunks, not waypoints")
    return waypoint_count(runner.policy) if runner.kind == "waypoints" else None


def _check_prediction(pred: np.ndarray, action_shape: tuple[int, ...], kind: str, env_label: str) -> None:
    if kind == "waypoints":
        if pred.shape[1:] != action_shape:
            raise ValueError(f"policy predicts waypoints of shape {pred.shape[1:]} but the follower of {env_label} "
                             f"expects {action_shape}")
    elif (pred.shape[-1],) != action_shape:
        raise ValueError(f"policy predicts {pred.shape[-1]}-D actions but {env_label} takes actions of shape "
                         f"{action_shape} (wrong checkpoint for this env? or set mapping.action_scale)")


def _checked_first(runner: PolicyRunner, action_shape: tuple[int, ...], label: str) -> Callable[[Any], np.ndarray]:
    """The first prediction of an episode batch, with what the policy returns checked against the env."""

    def first_prediction(obs: Any) -> np.ndarray:
        try:
            pred = runner.predict(obs)
        except (ValueError, KeyError) as exc:
            raise ValueError(f"the policy cannot act in {label} (observation keys "
                             f"{sorted(k for k in obs if k != 'task')}): {exc}") from exc
        _check_prediction(pred, action_shape, runner.kind, label)
        return pred

    return first_prediction


def _executor(cfg: EvalConfig, kind: str, width: int) -> ChunkExecutor:
    return ChunkExecutor(cfg.chunk.mode, cfg.chunk.steps_per_chunk, cfg.chunk.ensemble_coeff,
                         cfg.chunk.crossfade_steps, kind=kind, n_envs=width)


def _episodes(runner: PolicyRunner, cfg: EvalConfig, envs: Any, every_step: bool, label: str, seeds: list[int],
              on_finish: Callable[[int], None] | None = None) -> tuple[list[dict], int, float | None]:
    """The episodes of ``seeds`` on ``envs`` (one row per env), the policy through a chunk executor;
    (episodes, env steps, the env's fps)."""
    first = _checked_first(runner, tuple(envs.single_action_space.shape), label)
    actor = PolicyActor(runner, _executor(cfg, runner.kind, envs.num_envs), every_step, first=first)
    episodes, env_steps = run_episodes(envs, actor, seeds, runner.per_row_reset, on_finish=on_finish)
    return episodes, env_steps, float(envs.metadata.get("render_fps") or 0) or None


def _worker_env(worker: Any, spec: EvalEnvSpec) -> Any:
    """The worker's one-row env of the split, built once per split and kept between its episodes."""
    return worker.keep(spec, lambda: make_eval_vector_env(spec, 1))


def episode_on_worker(worker: Any, job: tuple) -> dict:
    """One evaluation episode in a Ray rollout worker (:class:`robopolicy.scale.ray_backend.RolloutWorker`):
    the worker's policy through its own chunk executor on its env of the split (built once per
    split), as one row of the local vector env runs it. ``job``: ``(spec, cfg, every_step, label,
    seed)``. Returns the episode summary, its env steps, the policy's calls and seconds, the env's fps."""
    spec, cfg, every_step, label, seed = job
    runner = PolicyRunner(worker.policy)
    records, steps, fps = _episodes(runner, cfg, _worker_env(worker, spec), every_step, label, [seed])
    return {"episode": records[0], "env_steps": steps, "calls": runner.calls, "seconds": runner.seconds, "fps": fps}


def _run_local(runner: PolicyRunner, cfg: EvalConfig, spec: EvalEnvSpec, width: int, every_step: bool, label: str,
               seeds: list[int], bar: Any) -> tuple[list[dict], int, float | None, float]:
    """The split's episodes on a local vector env of ``width`` rows; (episodes, env steps, fps,
    seconds the env processes took to start)."""
    t0 = time.perf_counter()
    envs = make_eval_vector_env(spec, width)
    start = time.perf_counter() - t0
    try:
        return (*_episodes(runner, cfg, envs, every_step, label, seeds, on_finish=bar.update), start)
    finally:
        envs.close()


def _env_on_worker(worker: Any, spec: EvalEnvSpec) -> None:
    """Build (and keep) the worker's env of the split: its start, before the first episode."""
    _worker_env(worker, spec)


def _run_on_ray(pool: Any, runner: PolicyRunner, cfg: EvalConfig, spec: EvalEnvSpec, every_step: bool, label: str,
                seeds: list[int], bar: Any) -> tuple[list[dict], int, float | None, float]:
    """The split's episodes on the Ray workers of ``pool``, one seed per call; (episodes, env steps, fps,
    seconds until every worker held the policy and its env). The workers' policy calls and seconds
    are added to ``runner``'s."""
    t0 = time.perf_counter()
    pool.map(_env_on_worker, [spec] * pool.size)
    start = time.perf_counter() - t0
    results = pool.map(episode_on_worker, [(spec, cfg, every_step, label, s) for s in seeds],
                       on_result=lambda i, r: bar.update(1))
    runner.calls += sum(r["calls"] for r in results)
    runner.seconds += sum(r["seconds"] for r in results)
    fps = results[0]["fps"] if results else None
    return [r["episode"] for r in results], sum(r["env_steps"] for r in results), fps, start


def run_split(runner: PolicyRunner, cfg: EvalConfig, split: str | None, log: Callable[[str], None] = print,
              pool: Any = None) -> SplitResult:
    """Evaluate ``cfg.episodes`` seeded episodes of one split; see the module docstring. ``pool``: the
    Ray workers (:class:`robopolicy.scale.ray_backend.RolloutPool`) with ``backend: ray``."""
    from tqdm import tqdm

    env_cfg = split_env_config(cfg, split, runner.policy)
    label = env_cfg.label()
    n = cfg.episodes
    seeds = [cfg.seed + i for i in range(n)]
    video_dir = Path(cfg.out) / "videos"
    slug = label.replace("[", "_").replace("]", "")
    videos = {seeds[i]: str(video_dir / f"{slug}_ep{i:03d}_seed{seeds[i]}.mp4") for i in range(min(cfg.videos, n))}
    spec = EvalEnvSpec(env=env_cfg, mapping=cfg.mapping_for_policy(), waypoints=_follower_waypoints(cfg, runner),
                       videos=videos, max_steps=cfg.max_steps, success_rule=cfg.success,
                       oracle=bool(getattr(runner.policy, "drives_with_oracle", False)))
    every_step = cfg.chunk.predict_every_step
    if every_step is None:  # a policy with temporal context must see every frame
        every_step = runner.has_context and not runner.can_observe
    if runner.kind == "waypoints" and cfg.chunk.mode != "chunk":
        raise ConfigError(f"chunk.mode={cfg.chunk.mode} applies to action chunks; a waypoint policy needs chunk.mode=chunk")

    t0 = time.perf_counter()
    calls0, secs0 = runner.calls, runner.seconds
    reruns0 = pool.stats.reruns if pool is not None else 0
    with tqdm(total=n, unit="ep", desc=label, disable=not cfg.progress, dynamic_ncols=True, leave=False) as bar:
        if pool is not None:
            episodes, env_steps, fps, start = _run_on_ray(pool, runner, cfg, spec, every_step, label, seeds, bar)
        else:
            episodes, env_steps, fps, start = _run_local(runner, cfg, spec, min(cfg.workers, n), every_step, label,
                                                         seeds, bar)
    reruns = pool.stats.reruns - reruns0 if pool is not None else 0
    warning = unreported_success(episodes)
    if warning:
        log(f"[eval] WARNING {label}: {warning}; name the env's success key, or give an env that reports one")
    seconds = time.perf_counter() - t0
    calls = runner.calls - calls0
    ms = 1000.0 * (runner.seconds - secs0) / calls if calls else float("nan")
    result = SplitResult(
        label=label, split=split, summary=summarize_split(cfg.env.id, episodes, fps), episodes=episodes,
        seconds=seconds, env_steps=env_steps, policy_calls=calls, policy_ms_per_call=ms,
        videos=[e["video"] for e in episodes if e.get("video")], reruns=reruns, start_seconds=start,
    )
    if reruns:
        log(f"[eval] {label}: {reruns} env worker(s) died and were replaced; their episodes ran again")
    log(f"[eval] {label}: {len(episodes)} episodes in {seconds:.1f} s, workers' start {start:.1f} s of it "
        f"({result.steps_per_s:.0f} env steps/s, {ms:.1f} ms per policy call)")
    return result


def evaluate(policy: Any, cfg: EvalConfig, log: Callable[[str], None] = print, save: bool = True) -> EvalReport:
    """Evaluate ``policy`` on every split of ``cfg``; writes ``eval.json``, ``eval.md`` and videos
    under ``cfg.out`` when ``save``."""
    import torch

    from robopolicy.config import to_dict

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    started = time.time()
    runner = PolicyRunner(policy)
    pool = None
    if cfg.backend == "ray":  # workers that hold the policy, for every split
        from robopolicy.scale.ray_backend import RolloutPool

        pool = RolloutPool(policy, min(cfg.workers, cfg.episodes), cfg.ray, cfg.threads)
    try:
        splits = [run_split(runner, cfg, split, log, pool) for split in cfg.split_list()]
    finally:
        if pool is not None:
            pool.close()
    report = EvalReport(env_id=cfg.env.id, checkpoint=cfg.checkpoint, seed=cfg.seed, splits=splits, config=to_dict(cfg))
    if save:
        report.save(cfg.out)
        write_summary(cfg.out, kind="eval", config=cfg, seeds=[cfg.seed],
                      episodes=sum(len(s.episodes) for s in splits), started_at=started,
                      metrics={s.split or s.label: s.summary for s in splits},
                      extra={"env_id": cfg.env.id, "checkpoint": cfg.checkpoint, "backend": cfg.backend,
                             "episodes_rerun": sum(s.reruns for s in splits),
                             "seed_rule": "episode i of every split uses seed + i"})
    return report
