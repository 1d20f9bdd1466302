"""How PersonFollow episodes end, and whether the oracle could still have saved the failures.

    .venv/bin/python bench/tracking_failures.py checkpoint=outputs/train/track_stage3/final
    .venv/bin/python bench/tracking_failures.py checkpoint=outputs/refine/dagger_dt/final split=at episodes=200

Runs a waypoint policy (through pure pursuit, as ``robopolicy eval`` runs it) on the evaluation
seeds and sorts every episode by how it ended:

- ``success``; ``ended unsuccessful`` (the target finished its walk, the robot outside the band);
- ``lost`` (the target out of sight and range for too long);
- ``collision: target`` / ``collision: other person`` (the nearest person within 0.5 m is the target
  or not) / ``collision: obstacle or wall``.

For every collision it prints the robot's forward speed at contact and, walking back from the
contact, how many of the last ``window`` states had a person within 0.7 m (what DAgger's
``near_collision`` filter drops), whether the oracle, taking over at any of them, still avoids
collision and loss for ``horizon`` steps (``oracle_recovers``), and how many steps before contact
the latest such state is: how late the policy could still have been taught to avoid it.

For every contact with an obstacle or wall it also prints where on the robot's rim the contact
is (bearing from the heading: ahead, side, behind) and in how many of the last ``window`` states
the contact spot (the point of the obstacle or wall that is touched) lay inside the front
camera's horizontal field of view: whether the policy could have seen what it hit.

Over all steps it prints how fast the robot drives (mean and 90th percentile forward speed) and
how often, and how fast, it is within 0.5 m of an obstacle or wall: whether a policy collides
less because it drives slower or because it keeps its distance.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from robopolicy.config import load_config  # noqa: E402
from robopolicy.refine.common import NEAR_PERSON as NEAR  # noqa: E402  (DAgger's near_collision flag)
from sim_envs.person_follow.geometry import bearing, nearest_hazard  # noqa: E402
from sim_envs.person_follow.scene import ROBOT_RADIUS  # noqa: E402


@dataclass
class TrackingFailureConfig:
    checkpoint: str = ""
    """A waypoint (tracking) policy checkpoint."""
    split: str = "dt"
    episodes: int = 100
    seed: int = 100_000
    window: int = 10
    """States before a collision to inspect (and to probe with the oracle)."""
    horizon: int = 20
    """Steps the oracle must drive without collision or loss for a probed state to count as saved."""
    image_size: int = 96


def classify(info: dict) -> str:
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


KINDS = ("success", "ended unsuccessful", "lost", "collision: target", "collision: other person",
         "collision: obstacle or wall")


def main(argv: list[str]) -> int:
    from robopolicy.envs import EnvConfig
    from robopolicy.eval.policy_runner import to_policy_batch
    from robopolicy.refine.common import make_refine_env
    from robopolicy.models.loading import load_policy

    cfg = load_config(TrackingFailureConfig, None, argv)
    if not cfg.checkpoint:
        raise SystemExit("give checkpoint=DIR")
    torch.set_num_threads(1)
    policy = load_policy(cfg.checkpoint)
    if getattr(policy, "output", None) != "waypoints":
        raise SystemExit(f"{cfg.checkpoint}: not a waypoint policy (a tracking checkpoint is needed)")
    env = make_refine_env(EnvConfig("robopolicy/PersonFollow-v0", {"split": cfg.split, "image_size": cfg.image_size}),
                          waypoints=policy.horizon)
    base = env.unwrapped
    half_fov = 0.5 * base.hfov_deg
    counts = dict.fromkeys(KINDS, 0)
    collisions: list[dict] = []
    speeds, clearances = [], []  # every step: forward speed (m/s), the rim's gap to obstacles and walls (m)
    for e in tqdm(range(cfg.episodes), desc=f"episodes ({cfg.split})", unit="ep"):
        obs, info = env.reset(seed=cfg.seed + e)
        policy.reset()
        recent: list[tuple] = []  # (env state, info) of the states the last actions were taken in
        term = trunc = False
        while not (term or trunc):
            recent = (recent + [(base.get_state(), info)])[-cfg.window:]
            with torch.inference_mode():
                wp = policy.predict(to_policy_batch({k: ([v] if isinstance(v, str) else np.asarray(v)[None])
                                                     for k, v in obs.items()})).numpy()[0]
            obs, _r, term, trunc, info = env.step(wp)
            speeds.append(float(info["robot_velocity"][0]))
            clearances.append(float(info["robot_clearance"]))
        kind = classify(info)
        counts[kind] += 1
        if kind.startswith("collision"):
            near = [float(i["metrics"]["min_person_distance"]) < NEAR for _s, i in recent]
            saved = [base.oracle_recovers(i, cfg.horizon, state=s) for s, i in recent]
            before = [len(recent) - j for j, ok in enumerate(saved) if ok]  # steps before contact, saved states
            c = {"kind": kind, "speed": float(info["robot_velocity"][0]), "near": sum(near),
                 "near_saved": sum(a and b for a, b in zip(near, saved)),
                 "latest_saved": min(before) if before else None}
            if kind == "collision: obstacle or wall":
                obstacles = np.asarray(info["obstacles"])[np.asarray(info["obstacle_mask"], dtype=bool)]
                room = float(info["room_half_extent"])
                spot, _gap = nearest_hazard(np.asarray(info["robot_pose"], dtype=np.float64), ROBOT_RADIUS, obstacles, room)
                c["bearing"] = np.degrees(bearing(info["robot_pose"], spot))
                c["wall"] = bool(room - np.max(np.abs(spot)) < 1e-3)
                c["in_view"] = sum(abs(np.degrees(bearing(i["robot_pose"], spot))) <= half_fov for _s, i in recent)
            collisions.append(c)
    n = cfg.episodes
    print(f"\n| {cfg.checkpoint} ({cfg.split}) | episodes | share |\n|---|---:|---:|")
    for kind in KINDS:
        print(f"| {kind} | {counts[kind]} | {counts[kind] / n:.1%} |")
    clear = np.asarray(clearances)
    print(f"\ndriving, over {len(speeds)} steps: forward speed mean {np.mean(speeds):.2f} m/s (90th percentile "
          f"{np.percentile(speeds, 90):.2f}); rim within 0.5 m of an obstacle or wall in {np.mean(clear < 0.5):.1%} of the "
          f"steps (their mean forward speed {np.mean(np.asarray(speeds)[clear < 0.5]) if np.any(clear < 0.5) else float('nan'):.2f} m/s)")
    if collisions:
        saved = [c["latest_saved"] for c in collisions if c["latest_saved"] is not None]
        print(f"\ncollisions: {len(collisions)}; forward speed at contact: mean {np.mean([c['speed'] for c in collisions]):.2f} m/s; "
              f"states within {NEAR} m of a person among the last {cfg.window}: mean {np.mean([c['near'] for c in collisions]):.1f}, "
              f"of them saved by the oracle: mean {np.mean([c['near_saved'] for c in collisions]):.1f}")
        print(f"the oracle, taking over within the last {cfg.window} states, avoids {len(saved)} of {len(collisions)} "
              f"collisions; the latest state it still saves is a median "
              f"{np.median(saved) if saved else float('nan'):.0f} steps before contact")
    contacts = [c for c in collisions if "bearing" in c]
    if contacts:
        b = np.abs([c["bearing"] for c in contacts])
        print(f"\nobstacle or wall contacts: {len(contacts)} ({sum(c['wall'] for c in contacts)} walls); where on the rim: "
              f"ahead (|bearing| <= {half_fov:.0f} deg) {int((b <= half_fov).sum())}, side {int(((b > half_fov) & (b <= 135)).sum())}, "
              f"behind (> 135 deg) {int((b > 135).sum())}; the contact spot in the camera's view in a mean "
              f"{np.mean([c['in_view'] for c in contacts]):.1f} of the last {cfg.window} states "
              f"(never in view: {sum(c['in_view'] == 0 for c in contacts)})")
        print("| contact | bearing (deg) | wall | speed (m/s) | spot in view, last states | latest oracle-saved state |\n|---|---:|:-:|---:|---:|---:|")
        for j, c in enumerate(contacts):
            print(f"| {j} | {c['bearing']:.0f} | {'yes' if c['wall'] else 'no'} | {c['speed']:.2f} | {c['in_view']} / {cfg.window} | "
                  f"{c['latest_saved'] if c['latest_saved'] is not None else '-'} |")
    print(f"[tracking failures] {cfg.checkpoint} ({cfg.split}): success {counts['success'] / n:.1%}, "
          f"collision {sum(v for k, v in counts.items() if k.startswith('collision')) / n:.1%} of {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
