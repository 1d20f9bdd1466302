"""How a tracking policy's PersonFollow episodes end, and whether the oracle could still have saved
the failures.

    robopolicy diagnose tracking-failures --checkpoint outputs/train/track_stage3/final --split dt
    robopolicy diagnose tracking-failures --checkpoint outputs/refine/dagger_dt/final --split at --episodes 200

Runs a waypoint policy (through pure pursuit, as ``robopolicy eval`` runs it) on the evaluation
seeds and sorts every episode by how it ended:

- ``success``; ``ended unsuccessful`` (the target finished its walk, the robot outside the band);
- ``lost`` (the target out of sight and range for too long);
- ``collision: target`` / ``collision: other person`` (the nearest person at contact is the
  target or not) / ``collision: obstacle or wall``.

For every collision: the robot's forward speed at contact; among the last ``window`` states, how
many had a person within DAgger's ``near_collision`` distance, whether the oracle, taking over
there, still avoids collision and loss for ``horizon`` steps, and how many steps before contact
the latest such state is (how late the policy could still have been taught to avoid it). For a
contact with an obstacle or wall: where on the robot's rim it is (bearing from the heading) and
in how many of the last ``window`` states the touched spot lay in the camera's field of view.
Over all steps: how fast the robot drives, and how often (and how fast) its rim is within 0.5 m
of an obstacle or wall: whether a policy collides less because it drives slower or because it
keeps its distance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from robopolicy.envs import EnvConfig
from sim_envs.wrappers import NEAR_PERSON

KINDS = ("success", "ended unsuccessful", "lost", "collision: target", "collision: other person",
         "collision: obstacle or wall")
CLOSE = 0.5
"""m: a rim this close to an obstacle or wall counts as driving close to it."""


@dataclass
class TrackingFailuresConfig:
    checkpoint: str = ""
    """A waypoint (tracking) policy checkpoint."""
    split: str = "dt"
    """PersonFollow split: ``stt``, ``dt`` or ``at``."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """PersonFollow-v0's kwargs (e.g. ``max_steps``; ``split`` above wins); the image size is the
    checkpoint's."""
    episodes: int = 100
    seed: int = 100_000
    """Episode i runs seed + i (the evaluation seeds by default)."""
    window: int = 10
    """States before a collision to inspect (and to probe with the oracle)."""
    horizon: int = 20
    """Steps the oracle must drive without collision or loss for a probed state to count as saved."""
    threads: int = 1
    """torch CPU threads for the policy."""

    def __post_init__(self) -> None:
        if self.episodes < 1 or self.window < 1 or self.horizon < 1:
            raise ValueError(f"episodes, window and horizon must be >= 1, got {self.episodes}, {self.window}, "
                             f"{self.horizon}")


def classify(info: dict) -> str:
    """How an episode ended, from the info of its last step."""
    m, em = info["metrics"], info["episode_metrics"]
    if em["success"]:
        return "success"
    if m["collision"]:
        if not em["person_collision"]:
            return "collision: obstacle or wall"
        rel = info["people_poses"][:, :2] - info["robot_pose"][:2]
        dist = np.where(info["people_mask"], np.hypot(rel[:, 0], rel[:, 1]), np.inf)  # per slot
        return "collision: target" if int(np.argmin(dist)) == int(info["target_index"]) else "collision: other person"
    if m["lost"]:
        return "lost"
    return "ended unsuccessful"


def inspect_collision(task: Any, kind: str, info: dict, recent: list[tuple], horizon: int) -> dict:
    """What the last states before a collision allowed: people near, oracle rescues, and for an
    obstacle or wall where it touched and whether the camera saw the spot. ``recent``: the
    ``(env state, info)`` of the states the last actions were taken in, oldest first."""
    from sim_envs.person_follow.geometry import bearing, nearest_hazard
    from sim_envs.person_follow.scene import ROBOT_RADIUS

    near = [float(i["metrics"]["min_person_distance"]) < NEAR_PERSON for _s, i in recent]
    saved = [task.oracle_recovers(i, horizon, state=s) for s, i in recent]
    before = [len(recent) - j for j, ok in enumerate(saved) if ok]  # steps before contact, saved states
    c = {"kind": kind, "speed": float(info["robot_velocity"][0]), "near": sum(near),
         "near_saved": sum(a and b for a, b in zip(near, saved)), "latest_saved": min(before) if before else None}
    if kind == "collision: obstacle or wall":
        obstacles = np.asarray(info["obstacles"])[np.asarray(info["obstacle_mask"], dtype=bool)]
        room = float(info["room_half_extent"])
        spot, _gap = nearest_hazard(np.asarray(info["robot_pose"], dtype=np.float64), ROBOT_RADIUS, obstacles, room)
        half_fov = 0.5 * task.hfov_deg
        c["bearing"] = float(np.degrees(bearing(info["robot_pose"], spot)))
        c["wall"] = bool(room - np.max(np.abs(spot)) < 1e-3)
        c["in_view"] = int(sum(abs(np.degrees(bearing(i["robot_pose"], spot))) <= half_fov for _s, i in recent))
    return c


def run_episode(env: Any, actor: Any, seed: int, cfg: TrackingFailuresConfig) -> dict:
    """One episode: how it ended, its collision's inspection (or ``None``), and per step the forward
    speed (m/s) and the rim's clearance to obstacles and walls (m)."""
    task = env.unwrapped
    obs, info = env.reset(seed=seed)
    actor.reset()
    recent: list[tuple] = []
    speeds, clearances, term, trunc = [], [], False, False
    while not (term or trunc):
        recent = (recent + [(task.get_state(), info)])[-cfg.window:]
        obs, _r, term, trunc, info = env.step(actor.act(obs).astype(np.float32))
        speeds.append(float(info["robot_velocity"][0]))
        clearances.append(float(info["robot_clearance"]))
    kind = classify(info)
    collision = inspect_collision(task, kind, info, recent, cfg.horizon) if kind.startswith("collision") else None
    return {"kind": kind, "collision": collision, "speeds": speeds, "clearances": clearances}


def diagnose(cfg: TrackingFailuresConfig, progress: bool = True) -> dict:
    """Run the episodes of ``cfg`` and gather how they end (see the module docstring)."""
    import torch
    from tqdm import tqdm

    from robopolicy.diagnose.stepping import PolicyActor, make_diagnosis_env
    from robopolicy.models.loading import load_policy

    if not cfg.checkpoint:
        from robopolicy.config import ConfigError

        raise ConfigError("checkpoint: give the policy checkpoint to diagnose (--checkpoint DIR)")
    torch.set_num_threads(cfg.threads)
    policy = load_policy(cfg.checkpoint)
    actor = PolicyActor(policy)
    if actor.runner.kind != "waypoints":
        raise ValueError(f"{cfg.checkpoint}: not a waypoint policy (a tracking checkpoint is needed)")
    env = make_diagnosis_env(policy, EnvConfig("robopolicy/PersonFollow-v0", {**cfg.env_kwargs, "split": cfg.split}))
    counts, collisions, speeds, clearances = dict.fromkeys(KINDS, 0), [], [], []
    try:
        for e in tqdm(range(cfg.episodes), desc=f"episodes ({cfg.split})", unit="ep", disable=not progress,
                      leave=False):
            res = run_episode(env, actor, cfg.seed + e, cfg)
            counts[res["kind"]] += 1
            speeds += res["speeds"]
            clearances += res["clearances"]
            if res["collision"] is not None:
                collisions.append(res["collision"])
        half_fov = 0.5 * env.unwrapped.hfov_deg
    finally:
        env.close()
    speeds_a, clear = np.asarray(speeds), np.asarray(clearances)
    close = clear < CLOSE
    driving = {"steps": len(speeds), "speed_mean": float(speeds_a.mean()), "speed_p90": float(np.percentile(speeds_a, 90)),
               "close_share": float(close.mean()),
               "close_speed": float(speeds_a[close].mean()) if close.any() else float("nan")}
    return {"checkpoint": cfg.checkpoint, "split": cfg.split, "episodes": cfg.episodes, "seed": cfg.seed,
            "window": cfg.window, "counts": counts, "collisions": collisions, "driving": driving, "half_fov": half_fov}


def _collision_lines(collisions: list[dict], window: int) -> list[str]:
    saved = [c["latest_saved"] for c in collisions if c["latest_saved"] is not None]
    return [f"collisions: {len(collisions)}; forward speed at contact: mean "
            f"{np.mean([c['speed'] for c in collisions]):.2f} m/s; states within {NEAR_PERSON} m of a person among "
            f"the last {window}: mean {np.mean([c['near'] for c in collisions]):.1f}, of them saved by the oracle: "
            f"mean {np.mean([c['near_saved'] for c in collisions]):.1f}",
            f"the oracle, taking over within the last {window} states, avoids {len(saved)} of {len(collisions)} "
            f"collisions; the latest state it still saves is a median "
            f"{np.median(saved) if saved else float('nan'):.0f} steps before contact"]


def _contact_lines(contacts: list[dict], window: int, half_fov: float) -> list[str]:
    b = np.abs([c["bearing"] for c in contacts])
    lines = [f"obstacle or wall contacts: {len(contacts)} ({sum(c['wall'] for c in contacts)} walls); where on the "
             f"rim: ahead (|bearing| <= {half_fov:.0f} deg) {int((b <= half_fov).sum())}, side "
             f"{int(((b > half_fov) & (b <= 135)).sum())}, behind (> 135 deg) {int((b > 135).sum())}; the contact "
             f"spot in the camera's view in a mean {np.mean([c['in_view'] for c in contacts]):.1f} of the last "
             f"{window} states (never in view: {sum(c['in_view'] == 0 for c in contacts)})",
             "| contact | bearing (deg) | wall | speed (m/s) | spot in view, last states | latest oracle-saved state |",
             "|---|---:|:-:|---:|---:|---:|"]
    for j, c in enumerate(contacts):
        latest = c["latest_saved"] if c["latest_saved"] is not None else "-"
        lines.append(f"| {j} | {c['bearing']:.0f} | {'yes' if c['wall'] else 'no'} | {c['speed']:.2f} | "
                     f"{c['in_view']} / {window} | {latest} |")
    return lines


def report(result: dict) -> list[str]:
    """The breakdown as a markdown table, the driving and collision findings, a one-line summary last."""
    n, counts, d = result["episodes"], result["counts"], result["driving"]
    lines = [f"| {result['checkpoint']} ({result['split']}) | episodes | share |", "|---|---:|---:|"]
    lines += [f"| {kind} | {counts[kind]} | {counts[kind] / n:.1%} |" for kind in KINDS]
    lines.append(f"driving, over {d['steps']} steps: forward speed mean {d['speed_mean']:.2f} m/s (90th percentile "
                 f"{d['speed_p90']:.2f}); rim within {CLOSE} m of an obstacle or wall in {d['close_share']:.1%} of the "
                 f"steps (their mean forward speed {d['close_speed']:.2f} m/s)")
    if result["collisions"]:
        lines += _collision_lines(result["collisions"], result["window"])
    contacts = [c for c in result["collisions"] if "bearing" in c]
    if contacts:
        lines += _contact_lines(contacts, result["window"], result["half_fov"])
    collided = sum(v for k, v in counts.items() if k.startswith("collision"))
    lines.append(f"[diagnose] tracking-failures {result['checkpoint']} ({result['split']}): success "
                 f"{counts['success'] / n:.1%}, collision {collided / n:.1%}, lost {counts['lost'] / n:.1%} of {n}")
    return lines
