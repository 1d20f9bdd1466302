"""Where does a perceive-then-act policy fail: perception or action? Rollouts of a locator and an
actor on ArmPickPlace with parts of the locator's estimate swapped for the truth.

    .venv/bin/python experiments/probes/perceive_act.py locator=outputs/train/arm_locator/final \\
        actor=outputs/train/arm_actor_goal/final episodes=20 true=none,cube,bowl,both

``locator``: a camera policy with a ``locate`` head (``label.goal_grip``: the named cube from the
tool-centre point, the named bowl on the table); ``actor``: a state policy trained on that label
as its scene state (or a ``ModularPolicy`` directory as ``policy=DIR`` for both). For each
``true`` mode (``none``: the estimate as it is, what ``robopolicy eval`` runs; ``cube`` / ``bowl``:
that half from the env's ``info``; ``both``: the actor on true labels) it runs the same evaluation
seeds (``seed`` + i), ``steps_per_chunk`` actions of each chunk, and prints success, how often the
named cube was lifted, and the estimate's mean error on the states the policy itself visited
(every chunk decision), also split by whether the cube is lifted at the decision (beside the error
on oracle frames that ``experiments/probes/locate_error.py`` measures, this is the one the actor meets). A
markdown table at the end.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

MODES = ("none", "cube", "bowl", "both")
LIFTED_Z = 0.03  # m: the named cube's centre this high counts as lifted


def rollouts(locator, actor, mode: str, episodes: int, seed: int, steps_per_chunk: int) -> dict:
    import gymnasium as gym
    from tqdm import tqdm

    import sim_envs  # noqa: F401 - registers the envs

    size = int(locator.config.frame_size[0]) if locator.config.frame_size else 96
    env = gym.make("robopolicy/ArmPickPlace-v0", image_size=size).unwrapped
    wins = lifts = 0
    cube_err, bowl_err, held = [], [], []
    policy_s, calls = 0.0, 0
    for i in tqdm(range(episodes), desc=f"true={mode}", unit="ep"):
        obs, info = env.reset(seed=seed + i)
        locator.reset()
        actor.reset()
        done = lifted = False
        while not done:
            t0 = time.perf_counter()
            est = locator.locate(obs).numpy()[0]
            truth = np.asarray(info["goal_grip"], dtype=np.float32)
            cube_err.append(float(np.linalg.norm(est[:3] - truth[:3])))
            bowl_err.append(float(np.linalg.norm(est[3:5] - truth[3:5])))
            held.append(float(info["cube_pos"][info["goal_cube"]][2]) > LIFTED_Z)
            if mode in ("cube", "both"):
                est[:3] = truth[:3]
            if mode in ("bowl", "both"):
                est[3:] = truth[3:]
            chunk = actor.predict({"observation.state": obs["observation.state"][None],
                                   "observation.environment_state": est[None]})[0].numpy()
            policy_s += time.perf_counter() - t0
            calls += 1
            for k in range(min(steps_per_chunk, len(chunk))):
                obs, _, terminated, truncated, info = env.step(chunk[k])
                lifted |= float(info["cube_pos"][info["goal_cube"]][2]) > LIFTED_Z
                done = terminated or truncated
                if done:
                    break
                if k < steps_per_chunk - 1:
                    locator.observe(obs)  # keeps a temporal context in env steps
        wins += bool(info["is_success"])
        lifts += lifted
    env.close()
    err, held = 100 * np.asarray(cube_err), np.asarray(held, bool)

    def mean_cm(mask):
        return float(err[mask].mean()) if mask.any() else float("nan")

    return {"mode": mode, "success": wins / episodes, "lifted": lifts / episodes,
            "cube_cm": float(err.mean()), "cube_free_cm": mean_cm(~held), "cube_held_cm": mean_cm(held),
            "bowl_cm": 100 * float(np.mean(bowl_err)), "ms_per_call": 1000 * policy_s / max(calls, 1)}


def main(argv: list[str]) -> None:
    from robopolicy.models.policy import Policy

    args = dict(a.split("=", 1) for a in argv)
    torch.set_num_threads(int(args.get("threads", 1)))
    if "policy" in args:
        from robopolicy.models.modular import ModularPolicy

        both = ModularPolicy.load(args["policy"])
        locator, actor = both.locator, both.actor
    else:
        locator, actor = Policy.load(args["locator"]), Policy.load(args["actor"])
    if "locate" not in locator.aux:
        raise SystemExit("the locator has no locate head (model.aux_heads: [locate])")
    if locator.config.locate_label != "label.goal_grip":
        raise SystemExit(f"the locator estimates {locator.config.locate_label}; this script swaps halves of label.goal_grip")
    modes = args.get("true", "none,both").split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"true: {bad} not in {MODES}")
    episodes, seed = int(args.get("episodes", 20)), int(args.get("seed", 100000))
    spc = int(args.get("steps_per_chunk", actor.horizon))
    if locator.language is not None:
        locator.language.embed(["warm up"])  # load the sentence model before the clock runs
    rows = [rollouts(locator, actor, m, episodes, seed, spc) for m in modes]
    print(f"\n| true values given | success | cube lifted | cube estimate error (cm) | the same, cube on the table "
          f"| the same, cube lifted | bowl estimate error (cm) | ms per policy call |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['success']:.0%} | {r['lifted']:.0%} | {r['cube_cm']:.1f} | {r['cube_free_cm']:.1f} | "
              f"{r['cube_held_cm']:.1f} | {r['bowl_cm']:.1f} | {r['ms_per_call']:.0f} |")
    print(f"[perceive_act] {episodes} episodes from seed {seed}, {spc} steps per chunk: "
          + ", ".join(f"{r['mode']} {r['success']:.0%}" for r in rows))


if __name__ == "__main__":
    main(sys.argv[1:])
