"""Oracle demonstrations recorded into a LeRobot v3.0 dataset, in parallel and crash-safe.

W worker processes each build the env, roll out its oracle for the seeds they take from a
shared queue, and stage every episode with lerobot's writer (:class:`StagedEpisode`) into
``<out>/.staging/``. The parent process alone commits staged episodes into ``<out>``
(:func:`commit_staged`), so the dataset has one writer and is a complete LeRobot dataset after
every episode; no merge step is needed at the end. Failed oracle episodes are kept, marked in
``next.success`` per frame and in the ``robopolicy/success`` episode column, and can be
filtered out (``robopolicy dataset filter --success``).

Episode ``i`` uses seed ``seed + i``; ``resume=True`` skips the seeds already committed.

With ``poses=K`` the episodes are posed frames instead of oracle rollouts, for perception
training (a locator) over many more layouts than demonstrations hold: each episode holds
``layouts_per_episode`` reset layouts (seeds ``10**9 + seed·L + j``, away from evaluation seeds)
and K random kinematic poses of the task for each (the env's ``pose()``: arm joints, and the
objects it would be handling, set without physics). No oracle runs; a posed frame's action
and oracle label are the joint targets that hold its pose, so such a dataset trains
perception heads, not actions. Frames of one episode are not a trajectory.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from robopolicy.data import features as F
from robopolicy.data.recorder import (
    STAGING_DIR,
    DatasetError,
    StagedEpisode,
    commit_staged,
    create_dataset,
    read_episodes,
    read_info,
    recover,
)
from robopolicy.envs import EnvConfig, make_env
from robopolicy.scale.ray_backend import RayConfig


@dataclass
class CollectConfig:
    """Oracle collection into a LeRobot dataset (``robopolicy collect``)."""

    env: EnvConfig = field(default_factory=EnvConfig)
    episodes: int = 10  # total episodes wanted in the dataset (resume counts the ones already there)
    workers: int = 1  # oracle processes (1: run in this process), or Ray actors with backend=ray
    backend: str = "local"  # local: worker processes on this machine; ray: Ray actors (robopolicy[scale])
    ray: RayConfig = field(default_factory=RayConfig)  # with backend=ray: ray.address (None: a local Ray)
    noise: float = 0.1  # DART noise on the executed action; the recorded label stays clean
    seed: int = 0  # episode i uses seed + i
    out: str = "outputs/datasets/collect"
    resume: bool = False  # continue an existing dataset in ``out``
    image_size: int | None = None  # camera size in px (passed to the env); None: env default
    vcodec: str = "libsvtav1"  # lerobot video codec: libsvtav1 (lerobot's default), h264, hevc
    poses: int = 0  # 0: oracle episodes; K > 0: posed frames, K poses of each layout
    layouts_per_episode: int = 16  # posed frames: layouts in one episode (fewer, longer videos)
    pose_phases: dict[str, float] = field(default_factory=dict)  # posed frames: phase weights, over the env's defaults
    progress: bool = True


@dataclass
class CollectSummary:
    """What a collection run did (the end-of-run table)."""

    episodes: int  # committed in this run
    frames: int
    successes: int
    seconds: float
    total_episodes: int  # in the dataset now
    errors: list[str] = field(default_factory=list)
    posed: bool = False  # posed frames, not oracle episodes: there is no success to report
    reruns: int = 0  # episodes run again because their worker died (backend=ray)

    @property
    def frames_per_s(self) -> float:
        return self.frames / self.seconds if self.seconds > 0 else 0.0

    def table(self) -> str:
        """Markdown table of the run."""
        rate = f"{self.successes}/{self.episodes}" + (f" ({self.successes / self.episodes:.0%})" if self.episodes else "")
        rows = [("episodes (this run)", str(self.episodes)), ("episodes (dataset)", str(self.total_episodes)),
                ("frames", str(self.frames)), ("posed frames (no oracle)", "yes") if self.posed else ("oracle success", rate),
                ("time", f"{self.seconds:.1f} s"), ("frames/s", f"{self.frames_per_s:.1f}")]
        if self.errors:
            rows.append(("errors", str(len(self.errors))))
        if self.reruns:
            rows.append(("episodes rerun (worker died)", str(self.reruns)))
        width = max(len(r[0]) for r in rows)
        lines = [f"| {'':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
        return "\n".join(lines)


def env_config_with_size(cfg: CollectConfig) -> EnvConfig:
    """The env config with ``image_size`` applied."""
    kwargs = dict(cfg.env.kwargs)
    if cfg.image_size is not None:
        kwargs["image_size"] = int(cfg.image_size)
    return EnvConfig(id=cfg.env.id, kwargs=kwargs)


def oracle_frame(features: dict, obs: dict, info: dict, decision: Any, reward: float, done: bool,
                 success: bool) -> dict[str, Any]:
    """One dataset frame from the observation/info before a step and the step's outcome."""
    frame: dict[str, Any] = {}
    for key in features:
        if key in obs and key != F.TASK:
            frame[key] = obs[key]
    frame[F.ACTION] = decision.action
    frame[F.ORACLE_ACTION] = decision.label
    if F.ORACLE_WAYPOINTS in features:
        frame[F.ORACLE_WAYPOINTS] = decision.extras["waypoints"]
    if F.TARGET_BOX in features:
        frame[F.TARGET_BOX] = info["target_box"]
    if F.TARGET_VISIBLE in features:
        frame[F.TARGET_VISIBLE] = bool(info["target_visible"])
    if F.FREE_RUN in features:
        frame[F.FREE_RUN] = info["free_run"]
    if F.GOAL_POS in features:
        frame[F.GOAL_POS] = info["goal_pos"]
    for key in (F.GOAL_REL, F.GOAL_GRIP):
        if key in features:
            frame[key] = info[key.removeprefix("label.")]
    frame[F.INTERVENTION] = False
    frame[F.REWARD] = float(reward)
    frame[F.DONE] = bool(done)
    frame[F.SUCCESS] = bool(success)
    return frame


def record_oracle_episode(env: Any, staged: StagedEpisode, seed: int, noise: float,
                          on_frame: Callable[[int], None] | None = None) -> tuple[int, bool]:
    """Roll out the env's oracle for one seed into ``staged``; returns (frames, success)."""
    from sim_envs.core import make_oracle

    oracle = make_oracle(env, noise=noise, seed=seed)
    obs, info = env.reset(seed=seed)
    oracle.reset(obs, info)
    return record_episode(env, oracle.act, staged, obs, info, on_frame)


def record_episode(env: Any, decide: Callable[[dict, dict], Any], sink: Any, obs: dict, info: dict,
                   on_frame: Callable[[int], None] | None = None) -> tuple[int, bool]:
    """Step ``env`` from ``(obs, info)`` with ``decide(obs, info) -> OracleStep`` (its action runs,
    its label is stored) until the episode ends, adding each frame to ``sink`` (a staged episode or
    a recorder: ``features`` and ``add_frame(frame, task)``); returns (frames, success)."""
    task = str(obs.get(F.TASK, ""))
    base = getattr(env, "unwrapped", env)
    free_run = base.free_run_label if F.FREE_RUN in sink.features else None  # computed per frame on request
    steps, success = 0, False
    while True:
        decision = decide(obs, info)
        next_obs, reward, terminated, truncated, next_info = env.step(decision.action)
        success = bool(next_info.get("is_success", False))
        done = bool(terminated or truncated)
        if free_run is not None:
            info = {**info, "free_run": free_run(info)}
        sink.add_frame(oracle_frame(sink.features, obs, info, decision, reward, done, success), task)
        steps += 1
        if on_frame is not None:
            on_frame(steps)
        obs, info = next_obs, next_info
        if done:
            return steps, success


POSED_SEED_BASE = 10**9


@dataclass(frozen=True)
class PosedFrames:
    """What a posed-frame episode holds: ``layouts`` reset layouts, ``poses`` poses of each,
    drawn with the env's pose phase weights changed by ``phases``."""

    poses: int
    layouts: int = 1
    phases: dict[str, float] = field(default_factory=dict)


def check_posable(env: Any, posed: PosedFrames) -> None:
    """Posed frames need the env's ``pose()``, absolute joint actions (a pose's action holds it)
    and phase weights the env knows; raises :class:`DatasetError` before anything is written."""
    base = getattr(env, "unwrapped", env)
    if not callable(getattr(base, "pose", None)):
        raise DatasetError(f"{type(base).__name__} has no pose(): posed frames (poses > 0) are for the arm tasks")
    if getattr(base, "action_mode", "joint") != "joint":
        raise DatasetError("posed frames need action_mode=joint (a pose's action is its joint targets)")
    try:
        base.pose_weights(posed.phases or None)
    except ValueError as exc:
        raise DatasetError(f"pose_phases: {exc}") from None


def record_posed_episode(env: Any, staged: StagedEpisode, seed: int, posed: PosedFrames,
                         on_frame: Callable[[int], None] | None = None) -> tuple[int, bool]:
    """``posed.layouts`` reset layouts (seeds ``10**9 + seed·layouts + j``) with ``posed.poses``
    random poses each into ``staged``; returns (frames, False). Every frame's action and label
    hold its pose: the joint targets of the observed joint state."""
    import numpy as np

    from sim_envs.core import OracleStep

    base = env.unwrapped
    rng = np.random.default_rng([seed, 0x9053])
    total, n = posed.poses * posed.layouts, 0
    for j in range(posed.layouts):
        env.reset(seed=POSED_SEED_BASE + seed * posed.layouts + j)
        for _ in range(posed.poses):
            obs, info = base.pose(rng, posed.phases or None)
            hold = np.asarray(obs[F.STATE], dtype=np.float32)
            n += 1
            staged.add_frame(oracle_frame(staged.features, obs, info, OracleStep(action=hold, label=hold), 0.0,
                                          n == total, False), str(obs.get(F.TASK, "")))
            if on_frame is not None:
                on_frame(n)
    return n, False


def _stage_one(env: Any, root: Path, features: dict, fps: int, seed: int, noise: float, vcodec: str,
               robot_type: str | None, tag: str, on_frame: Callable[[int], None] | None = None,
               posed: PosedFrames | None = None) -> dict:
    staged = StagedEpisode(root / STAGING_DIR / f"{tag}-seed{seed}-{uuid.uuid4().hex[:6]}", features, fps,
                           robot_type=robot_type, vcodec=vcodec)
    t0 = time.perf_counter()
    try:
        if posed is not None:
            steps, success = record_posed_episode(env, staged, seed, posed, on_frame)
        else:
            steps, success = record_oracle_episode(env, staged, seed, noise, on_frame)
        summary = staged.save(success=success, seed=seed)
    except BaseException:
        staged.discard()
        raise
    return {"seed": seed, "path": summary.staged_path, "frames": steps, "success": success,
            "seconds": time.perf_counter() - t0, "late": summary.cadence.late_frames}


def quiet_encoders() -> None:
    """Keep per-episode encoder chatter (x264 / SVT-AV1 banners, the datasets library's "Map"
    bars, lerobot's bool-stats casts) off the console; the collector prints its own progress."""
    import os
    import warnings

    import av
    import datasets

    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 reads it when its first encoder opens: errors only
    av.logging.set_level(av.logging.ERROR)
    datasets.disable_progress_bars()
    warnings.filterwarnings("ignore", message="Converting input from bool", category=RuntimeWarning)


def _worker(worker_id: int, env_cfg: dict, root: str, features: dict, fps: int, noise: float, vcodec: str,
            robot_type: str | None, seeds: Any, results: Any, posed: PosedFrames | None = None) -> None:
    """Worker process: take seeds until a None, stage each episode, report it."""
    import os

    os.environ.setdefault("MUJOCO_GL", "egl")
    quiet_encoders()
    env = make_env(EnvConfig(**env_cfg), render_mode=None)
    try:
        while True:
            seed = seeds.get()
            if seed is None:
                break
            try:
                results.put(("ok", _stage_one(env, Path(root), features, fps, seed, noise, vcodec, robot_type,
                                              f"w{worker_id}", posed=posed)))
            except Exception:
                results.put(("error", {"seed": seed, "error": traceback.format_exc()}))
    finally:
        env.close()
        results.put(("exit", {"worker": worker_id}))


def committed_seeds(root: Path) -> set[int]:
    """Seeds of the episodes already committed in ``root`` (from the episode metadata)."""
    episodes = read_episodes(root)
    if episodes is None or F.EPISODE_SEED not in episodes.column_names:
        return set()
    return {int(s) for s in episodes[F.EPISODE_SEED].to_pylist() if s is not None and s >= 0}


def collect(cfg: CollectConfig, log: Callable[[str], None] = print) -> CollectSummary:
    """Run the collection described by ``cfg``; returns the summary (see the module docstring)."""
    if cfg.episodes < 1 or cfg.workers < 1 or cfg.poses < 0 or cfg.layouts_per_episode < 1:
        raise ValueError(f"episodes, workers and layouts_per_episode must be >= 1 and poses >= 0, got "
                         f"episodes={cfg.episodes} workers={cfg.workers} poses={cfg.poses} "
                         f"layouts_per_episode={cfg.layouts_per_episode}")
    if cfg.backend not in ("local", "ray"):
        raise ValueError(f"backend must be local or ray, got {cfg.backend!r}")
    quiet_encoders()
    root = Path(cfg.out)
    env_cfg = env_config_with_size(cfg)
    env = make_env(env_cfg, render_mode=None)
    posed = PosedFrames(cfg.poses, cfg.layouts_per_episode, dict(cfg.pose_phases)) if cfg.poses else None
    if posed is not None:
        try:
            check_posable(env, posed)
        except DatasetError:
            env.close()
            raise
    features = F.env_features(env)
    fps = int(env.metadata.get("render_fps", 10))
    robot_type = env_cfg.id.split("/")[-1]

    if (root / "meta" / "info.json").exists():
        if not cfg.resume:
            env.close()
            raise DatasetError(f"{root}: a dataset already exists; use --resume to continue it or pick a new --out")
        report = recover(root)
        if report.removed:
            log(f"[collect] resume: cleaned {len(report.removed)} leftover(s) of an interrupted run")
        info = read_info(root)
        from robopolicy.data.recorder import check_same_features

        check_same_features({k: v for k, v in info["features"].items() if k in features}, features,
                            f"resume {root} with {env_cfg.label()}")
        done_seeds = committed_seeds(root)
    else:
        create_dataset(root, features, fps, robot_type)
        done_seeds = set()
    todo = [cfg.seed + i for i in range(cfg.episodes) if cfg.seed + i not in done_seeds]
    what = (f"{posed.layouts} layouts x {posed.poses} posed frames each" if posed is not None
            else f"noise {cfg.noise}")
    log(f"[collect] {env_cfg.label()}: {len(todo)} episode(s) to record ({len(done_seeds)} already in {root}), "
        f"{cfg.workers} worker(s){' (Ray actors)' if cfg.backend == 'ray' else ''}, {what}")

    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), unit="ep", disable=not cfg.progress, dynamic_ncols=True)
    t0 = time.perf_counter()
    frames = successes = committed = 0
    errors: list[str] = []
    reruns = 0

    def on_result(result: dict) -> None:
        nonlocal frames, successes, committed
        commit_staged(root, result["path"])
        frames += result["frames"]
        successes += int(result["success"])
        committed += 1
        elapsed = time.perf_counter() - t0
        shown = {} if posed is not None else {"success": f"{successes}/{committed}"}
        bar.set_postfix(**shown, fps=f"{frames / max(elapsed, 1e-9):.0f}")
        bar.update(1)

    try:
        if cfg.backend == "ray":
            from robopolicy.scale.ray_backend import collect_on_ray

            env.close()
            env_dict = {"id": env_cfg.id, "kwargs": dict(env_cfg.kwargs)}
            reruns = collect_on_ray(cfg.ray, cfg.workers, env_dict, root, features, fps, cfg.noise, cfg.vcodec,
                                    robot_type, todo, on_result, errors, posed).reruns
        elif cfg.workers == 1 or len(todo) <= 1:
            for seed in todo:
                on_result(_stage_one(env, root, features, fps, seed, cfg.noise, cfg.vcodec, robot_type, "w0",
                                     posed=posed))
        else:
            env.close()
            _run_workers(cfg, env_cfg, root, features, fps, robot_type, todo, on_result, errors, posed)
    finally:
        bar.close()
        env.close()
    seconds = time.perf_counter() - t0
    return CollectSummary(committed, frames, successes, seconds, int(read_info(root)["total_episodes"]), errors,
                          posed=posed is not None, reruns=reruns)


def _run_workers(cfg: CollectConfig, env_cfg: EnvConfig, root: Path, features: dict, fps: int,
                 robot_type: str | None, todo: list[int], on_result: Callable[[dict], None],
                 errors: list[str], posed: PosedFrames | None = None) -> None:
    ctx = mp.get_context("spawn")  # no fork: the parent may hold a GL context
    seeds, results = ctx.Queue(), ctx.Queue()
    n = min(cfg.workers, len(todo))
    for seed in todo:
        seeds.put(seed)
    for _ in range(n):
        seeds.put(None)
    env_dict = {"id": env_cfg.id, "kwargs": dict(env_cfg.kwargs)}
    procs = [ctx.Process(target=_worker, args=(i, env_dict, str(root), features, fps, cfg.noise, cfg.vcodec,
                                                robot_type, seeds, results, posed),
                         daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    running = n
    try:
        while running:
            try:
                kind, payload = results.get(timeout=5.0)
            except queue_mod.Empty:
                if not any(p.is_alive() for p in procs):
                    raise RuntimeError("all collection workers died (see their output above)") from None
                continue
            if kind == "ok":
                on_result(payload)
            elif kind == "error":
                errors.append(f"seed {payload['seed']}: {payload['error']}")
                print(f"[collect] seed {payload['seed']} failed:\n{payload['error']}", flush=True)
            else:
                running -= 1
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()

