"""Unattended collection on one continuous world (RoboClaw's forward/reset pairing).

    robopolicy collect --unattended --env robopolicy/ArmPickPlace-v0 --episodes 100 --out data/pp_unattended

A real robot that collects for hours has nobody to set its table between episodes. Here, after
every forward episode (the oracle, or a policy with ``policy=CHECKPOINT``, does the task) a
reset behaviour (:mod:`sim_envs.arm.rearrange`: scripted by default, a learned one through
``reset=module:factory``) moves every cube to a new sampled layout and the next episode starts
there, with a new goal, without ``env.reset``. The layout check, not the behaviour, judges each
reset. A failed reset is tried again with a new layout; after ``retries`` failures in a row, or
at once when nothing the arm can do would fix it (a cube knocked out of its reach), a hard
``env.reset`` (a person setting the table) recovers, and is counted as such.

Every forward episode is recorded (LeRobot v3 through the one :class:`EpisodeRecorder`; failed
ones too, marked in ``robopolicy/success``); resets are not. A progress line per episode, a
one-line summary and ``<out>/summary.json`` (episodes, frames, resets attempted / succeeded,
hard resets, episodes per hour, the machine's load average at the start and the end) close the run.
"""

from __future__ import annotations

import importlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from robopolicy.envs import EnvConfig


@dataclass
class UnattendedConfig:
    """``robopolicy collect --unattended``: forward episodes and scripted resets on one world."""

    env: EnvConfig = field(default_factory=lambda: EnvConfig(id="robopolicy/ArmPickPlace-v0"))
    episodes: int = 100  # forward episodes to record
    policy: str | None = None  # a checkpoint that drives the forward episodes; None: the task's oracle
    steps_per_chunk: int | None = None  # with a policy: chunk steps executed per prediction (None: the whole chunk)
    noise: float = 0.1  # the oracle's DART noise on the executed action (forward episodes)
    seed: int = 0
    out: str = "outputs/datasets/unattended"
    image_size: int | None = None
    vcodec: str = "libsvtav1"
    reset: str = "scripted"  # the reset behaviour: scripted, or module:factory (factory(seed) -> ResetBehaviour)
    reset_noise: float = 0.0  # the scripted reset's own oracle noise
    tolerance: float = 0.015  # m: how close (xy) each cube must lie to its sampled place
    retries: int = 3  # failed resets in a row before a hard env.reset
    summary: str | None = None  # directory of summary.json (None: out)
    progress: bool = True


@dataclass
class UnattendedStats:
    """What an unattended run did."""

    episodes: int = 0
    frames: int = 0  # recorded frames: every control step of the forward episodes
    successes: int = 0
    resets_attempted: int = 0
    resets_succeeded: int = 0
    hard_resets: int = 0
    reset_steps: int = 0
    failures: Counter = field(default_factory=Counter)  # failed resets by kind (rearrange.LayoutCheck.kind)
    since_env_reset: int = 0  # episodes since the last env.reset (the first one included)
    longest_without_env_reset: int = 0  # the most episodes one stretch of the world ran without env.reset
    wall_s: float = 0.0

    @property
    def episodes_per_hour(self) -> float:
        return 3600.0 * self.episodes / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def reset_success_rate(self) -> float:
        return self.resets_succeeded / self.resets_attempted if self.resets_attempted else 0.0

    def line(self) -> str:
        return (f"{self.episodes} episodes ({self.successes} successful), {self.frames} frames; resets "
                f"{self.resets_succeeded}/{self.resets_attempted} succeeded ({self.reset_success_rate:.1%}), "
                f"{self.hard_resets} hard env.reset; {self.wall_s:.0f}s, {self.episodes_per_hour:.0f} episodes/hour")

    def metrics(self) -> dict[str, Any]:
        return {"episodes": self.episodes, "frames": self.frames, "successes": self.successes,
                "resets_attempted": self.resets_attempted, "resets_succeeded": self.resets_succeeded,
                "reset_success_rate": round(self.reset_success_rate, 4), "hard_resets": self.hard_resets,
                "forward_steps": self.frames, "reset_steps": self.reset_steps,
                "longest_without_env_reset": self.longest_without_env_reset, "reset_failures": dict(self.failures),
                "episodes_per_hour": round(self.episodes_per_hour, 1)}


def make_reset_behaviour(cfg: UnattendedConfig) -> Any:
    """The configured reset behaviour: ``scripted`` or ``module:factory`` (``factory(seed=...)``
    returns an object with ``rearrange(env, layout) -> steps``, e.g. a learned reset policy)."""
    from robopolicy.config import ConfigError
    from sim_envs.arm.rearrange import ScriptedRearrange

    if cfg.reset == "scripted":
        return ScriptedRearrange(noise=cfg.reset_noise, seed=cfg.seed + 1, tolerance=cfg.tolerance)
    module, _, name = cfg.reset.partition(":")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"reset: {cfg.reset!r} is neither 'scripted' nor an importable module:factory ({exc})") from None
    behaviour = factory(seed=cfg.seed + 1)
    if not callable(getattr(behaviour, "rearrange", None)):
        raise ConfigError(f"reset: {cfg.reset} returned {type(behaviour).__name__}, which has no rearrange(env, layout)")
    return behaviour


class _Driver:
    """Who does the forward episodes: the task's oracle (noisy actions, clean labels) or a policy
    (its actions, the oracle's relabelled action as the label)."""

    def __init__(self, env: Any, cfg: UnattendedConfig):
        from sim_envs.core import make_oracle

        self.oracle = make_oracle(env, noise=0.0 if cfg.policy else cfg.noise, seed=cfg.seed)
        self.act = self.reset_policy = None
        if cfg.policy:
            from robopolicy.models.loading import load_policy
            from robopolicy.refine.dagger import policy_actor

            self.oracle.replan = True  # labels of states the policy drives to (DAgger's relabelling)
            self.act, self.reset_policy = policy_actor(load_policy(cfg.policy), cfg.steps_per_chunk, waypoints=False)

    def reset(self, obs: dict, info: dict) -> None:
        self.oracle.reset(obs, info)
        if self.reset_policy is not None:
            self.reset_policy(None)

    def decide(self, obs: dict, info: dict) -> Any:
        from robopolicy.diagnose.stepping import batched
        from sim_envs.core import OracleStep

        step = self.oracle.act(obs, info)
        if self.act is None:
            return step
        return OracleStep(action=np.asarray(self.act(batched(obs))[0], np.float32), label=step.label)


def forward_episode(env: Any, driver: _Driver, recorder: Any, obs: dict, info: dict) -> tuple[int, bool]:
    """One forward episode from the scene as it stands, recorded and committed; (frames, success)."""
    from robopolicy.data.collect import record_episode

    driver.reset(obs, info)
    recorder.start_episode()
    steps, success = record_episode(env, driver.decide, recorder, obs, info)
    recorder.save_episode(success=success)
    return steps, success


def reset_scene(env: Any, behaviour: Any, rng: np.random.Generator, cfg: UnattendedConfig,
                stats: UnattendedStats, say: Callable[[str], None]) -> tuple[dict, dict]:
    """Rearrange the scene into a new layout (retried; a hard ``env.reset`` after ``cfg.retries``
    failures in a row or an unrecoverable one); returns the next episode's (obs, info)."""
    from sim_envs.arm.rearrange import NoLayout, begin_episode, check_layout, sample_layout

    for attempt in range(1, cfg.retries + 1):
        stats.resets_attempted += 1
        try:
            layout = sample_layout(env, rng)
        except NoLayout as exc:  # the cubes crowd the table where they lie: nothing to aim the arm at
            stats.failures["no_room"] += 1
            say(f"[unattended] reset {stats.resets_attempted} failed: {exc}")
            break
        stats.reset_steps += int(behaviour.rearrange(env, layout))
        check = check_layout(env, layout, cfg.tolerance)
        if check.ok:
            stats.resets_succeeded += 1
            return begin_episode(env, layout)
        stats.failures[check.kind] += 1
        say(f"[unattended] reset {stats.resets_attempted} failed (attempt {attempt}/{cfg.retries}): {check.reason}")
        if not check.recoverable:
            break
    stats.hard_resets, stats.since_env_reset = stats.hard_resets + 1, 0
    say(f"[unattended] hard env.reset #{stats.hard_resets}")
    return env.reset(seed=cfg.seed + 1_000_000 + stats.hard_resets)


def _check(cfg: UnattendedConfig) -> None:
    from robopolicy.config import ConfigError

    if cfg.episodes < 1 or cfg.retries < 1 or not 0 < cfg.tolerance < 0.1 or cfg.noise < 0 or cfg.reset_noise < 0:
        raise ConfigError(f"unattended: episodes and retries must be >= 1, tolerance in (0, 0.1) m and noises >= 0; "
                          f"got episodes={cfg.episodes} retries={cfg.retries} tolerance={cfg.tolerance} "
                          f"noise={cfg.noise} reset_noise={cfg.reset_noise}")


def collect_unattended(cfg: UnattendedConfig, log: Callable[[str], None] = print) -> UnattendedStats:
    """Run the collection (see the module docstring); returns its stats, written to summary.json."""
    from robopolicy.config import ConfigError
    from robopolicy.data import features as F
    from robopolicy.data.collect import env_config_with_size, quiet_encoders
    from robopolicy.data.recorder import EpisodeRecorder
    from robopolicy.envs import make_env
    from robopolicy.utils.records import write_summary

    _check(cfg)
    quiet_encoders()
    env_cfg = env_config_with_size(cfg)
    env = make_env(env_cfg, render_mode=None)
    if not getattr(env.unwrapped, "num_cubes", 0):
        env.close()
        raise ConfigError(f"env.id {env_cfg.id}: unattended collection needs an arm task with cubes for the arm to "
                          f"rearrange (robopolicy/ArmPickPlace-v0, robopolicy/ArmPushCube-v0)")
    started, t0, load_start = time.time(), time.perf_counter(), os.getloadavg()
    stats = UnattendedStats()
    try:
        behaviour, driver = make_reset_behaviour(cfg), _Driver(env, cfg)
        recorder = EpisodeRecorder(cfg.out, F.env_features(env), int(env.metadata.get("render_fps", 10)),
                                   robot_type=env_cfg.id.split("/")[-1], vcodec=cfg.vcodec)
        rng = np.random.default_rng([cfg.seed, 0x5E7])
        obs, info = env.reset(seed=cfg.seed)  # the one reset that builds the world
        log(f"[unattended] {env_cfg.label()}: {cfg.episodes} episodes, forward by "
            f"{cfg.policy or f'the oracle (noise {cfg.noise})'}, reset by {cfg.reset}")
        try:
            while stats.episodes < cfg.episodes:
                frames, success = forward_episode(env, driver, recorder, obs, info)
                stats.episodes, stats.frames = stats.episodes + 1, stats.frames + frames
                stats.successes += int(success)
                stats.since_env_reset += 1
                stats.longest_without_env_reset = max(stats.longest_without_env_reset, stats.since_env_reset)
                stats.wall_s = time.perf_counter() - t0
                if cfg.progress:
                    log(f"[unattended] episode {stats.episodes}/{cfg.episodes} {'ok' if success else 'failed'} "
                        f"({frames} frames) | resets {stats.resets_succeeded}/{stats.resets_attempted} | hard "
                        f"{stats.hard_resets} | {stats.wall_s:.0f}s, {stats.episodes_per_hour:.0f} episodes/hour")
                if stats.episodes < cfg.episodes:
                    obs, info = reset_scene(env, behaviour, rng, cfg, stats, log)
        finally:
            recorder.close()
    finally:
        env.close()
    stats.wall_s = time.perf_counter() - t0
    write_summary(cfg.summary or cfg.out, kind="collect", config=cfg, seeds=[cfg.seed], episodes=stats.episodes,
                  metrics={**stats.metrics(), "load_average_1_5_15m": {"start": load_start, "end": os.getloadavg()}},
                  started_at=started, wall_time_s=stats.wall_s,
                  extra={"task": env_cfg.id, "title": f"unattended collection, {cfg.reset} resets"})
    log(f"[unattended] {stats.line()}")
    return stats
