"""How far a policy's ``locate`` head puts the named cube and bowl, on a dataset it was not trained on.

    .venv/bin/python experiments/probes/locate_error.py ckpt=outputs/train/arm_stage1/final \\
        dataset=outputs/datasets/arm_pick_place_val seed=100000

For a checkpoint with the ``locate`` aux head (``experiments/configs/train/arm_stage1_locate.yaml``, or the
locator of ``configs/train/arm/locator.yaml``, whose ``label.goal_grip`` / ``label.goal_rel``
estimates are put back in the world frame and also scored on the frames with the gripper near
the cube and with the cube carried) and an
ArmPickPlace dataset collected with ``--seed SEED`` (episode i: seed + i), over ``frames``
frames drawn at random (and every episode's first frame) it prints the mean / median xy error of
the named cube and bowl, the same over the first 15 frames of each episode (the arm still away,
nothing hidden), over the first frames alone (the arm has not moved yet: on oracle episodes the
arm's heading gives the cube away from the second frame on) and later ones,
again with the joint state zeroed (what the arm's own position tells the head) and with the
wrist camera blanked, and split by whether the instruction's cube colour is also one of the
bowls' colours (the case the pooled sentence embedding's weak word order would confuse).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

NEAR = 0.05  # m: "near" frames, the gripper this close to the named cube (relative labels only)
LIFTED_Z = 0.03  # m: the named cube's centre this high: carried


def main(argv: list[str]) -> None:
    import gymnasium as gym

    import sim_envs  # noqa: F401 - registers the envs
    from robopolicy.config import load_config
    from robopolicy.models.policy import Policy
    from robopolicy.train.trainer import TrainConfig, build_dataset

    args = dict(a.split("=", 1) for a in argv)
    ckpt, data, seed = args["ckpt"], args["dataset"], int(args.get("seed", 100000))
    n_frames = int(args.get("frames", 400))
    torch.set_num_threads(int(args.get("threads", 2)))
    pol = Policy.load(ckpt)
    pol.eval()
    if "locate" not in pol.aux:
        raise SystemExit(f"{ckpt} has no locate head (model.aux_heads: [locate])")
    label = pol.config.locate_label
    relative = label != "label.goal_pos"  # goal_rel / goal_grip: the cube (and bowl) from the gripper
    cfg = load_config(TrainConfig, args.get("config", "experiments/configs/train/arm_stage1_locate.yaml"),
                      [f"data.dataset={data}", "progress=false", f"model.locate_label={label}",
                       f"data.features.cameras=[{','.join(pol.cameras)}]",
                       f"data.features.labels=[label.goal_pos,{label}]" if relative else "data.features.labels=[label.goal_pos]"])
    ds = build_dataset(cfg, progress=False)
    env = gym.make("robopolicy/ArmPickPlace-v0", use_cameras=False)
    episodes = sorted({int(e["episode_index"]) for e in ds.cache.episodes})
    ambiguous = {}
    for ep in episodes:
        env.reset(seed=seed + ep)
        u = env.unwrapped
        ambiguous[ep] = u.cube_colors[u.goal_cube] in u.target_colors
    idx = np.random.default_rng(0).choice(len(ds), size=min(n_frames, len(ds)), replace=False)
    n_random = len(idx)  # the rows below are over these; the first-frame row over every episode's first frame
    firsts = np.flatnonzero(ds.frame_index == 0)
    idx = np.concatenate([idx, np.setdiff1d(firsts, idx)])
    rows = {v: [] for v in ("as recorded", "joint state zeroed", "wrist camera blank")}
    with torch.no_grad():
        for start in range(0, len(idx), 50):
            items = [ds[int(j)] for j in idx[start:start + 50]]
            batch = {k: torch.stack([it[k] for it in items]) for k in items[0] if isinstance(items[0][k], torch.Tensor)}
            batch["task"] = [it["task"] for it in items]
            goal = batch["label.goal_pos"].reshape(-1, 6)
            for variant in rows:
                b = dict(batch)
                if variant == "joint state zeroed":
                    b["observation.state"] = torch.zeros_like(b["observation.state"])
                if variant == "wrist camera blank" and "observation.images.wrist" in b:
                    b["observation.images.wrist"] = torch.zeros_like(b["observation.images.wrist"])
                feats, state = pol._context_features(b), b["observation.state"][:, 0]
                if pol.config.locate_head == "mlp":
                    pred = pol.aux["locate"](pol._locate_inputs(feats[:, pol._t0], state, b["task"]))
                else:
                    mem, pad, _ = pol._memory(feats, b.get("observation_is_pad"), state, b["task"])
                    pred = pol.aux["locate"](mem, pad)
                if relative:  # back to the world frame: the label is the goal minus the tool-centre point
                    pred = pred + (goal - batch[label].reshape(-1, 6))
                cube = (pred[:, :2] - goal[:, :2]).norm(dim=-1) * 100
                bowl = (pred[:, 3:5] - goal[:, 3:5]).norm(dim=-1) * 100
                near = batch[label].reshape(-1, 6)[:, :3].norm(dim=-1) < NEAR if relative else None
                lifted = goal[:, 2] > LIFTED_Z
                for k, it in enumerate(items):
                    ep = int(it["episode_index"])
                    rows[variant].append((int(it["frame_index"]) < 15, ambiguous[ep], float(cube[k]), float(bowl[k]),
                                          bool(near[k]) if near is not None else False,
                                          int(it["frame_index"]) == 0, start + k < n_random, bool(lifted[k])))
    print(f"\n{ckpt} on {data} ({n_random} frames of {len(episodes)} episodes at random, and the {len(firsts)} first frames): xy error in cm, mean (median)\n")
    print("| input | frames | named cube | named bowl |\n|---|---|---|---|")
    for variant, r in rows.items():
        r = np.asarray(r, dtype=float)
        rnd = r[:, 6] > 0
        for name, mask in (("all", rnd), ("first 15 of each episode", rnd & (r[:, 0] > 0)),
                           ("first of each episode", r[:, 5] > 0),
                           ("later", rnd & (r[:, 0] == 0)), (f"gripper within {NEAR * 100:.0f} cm of the cube", rnd & (r[:, 4] > 0)),
                           ("cube lifted (carried)", rnd & (r[:, 7] > 0)),
                           ("cube colour also a bowl's", rnd & (r[:, 1] > 0)), ("cube colour not a bowl's", rnd & (r[:, 1] == 0))):
            if not mask.any():
                continue
            if variant != "as recorded" and name not in ("all", "first 15 of each episode", "first of each episode"):
                continue
            c, b = r[mask, 2], r[mask, 3]
            print(f"| {variant} | {name} ({mask.sum()}) | {c.mean():.1f} ({np.median(c):.1f}) | {b.mean():.1f} ({np.median(b):.1f}) |")
    r = np.asarray(rows["as recorded"], dtype=float)
    f, r = r[r[:, 5] > 0], r[r[:, 6] > 0]
    print(f"\n[locate] named cube {r[:, 2].mean():.1f} cm, named bowl {r[:, 3].mean():.1f} cm off on average; "
          f"on the first frames {f[:, 2].mean():.1f} / {f[:, 3].mean():.1f} cm")


if __name__ == "__main__":
    main(sys.argv[1:])
