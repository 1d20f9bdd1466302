"""Can an encoder find the named cube and bowl in one PickPlace front view? A probe outside the policy.

    .venv/bin/python experiments/probes/locate_probe.py                      # FiLM + keypoints, 300 s
    .venv/bin/python experiments/probes/locate_probe.py film=false seconds=300 layouts=4000
    .venv/bin/python experiments/probes/locate_probe.py keypoint_features=false     # keypoint tokens = (x, y) only

Renders ``layouts`` fresh ArmPickPlace layouts at reset (arm at home, nothing hidden) and 500
unseen ones, and trains the project's ``VisionEncoder`` (ResNet-18 to layer2, 96 px, trainable;
``film`` and ``pool: keypoints`` as given) with a small MLP on the flattened tokens and the
instruction embedding, to regress the named cube's and bowl's xy. It prints the mean error on
the unseen layouts beside the anchor of predicting the training mean (what a model that cannot
see does). The policy's fusion transformer is not involved: this separates "the encoder cannot
localize" from "the policy does not use what the encoder sees".
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def render_layouts(n: int, seed: int):
    import gymnasium as gym

    import sim_envs  # noqa: F401 - registers the envs

    env = gym.make("robopolicy/ArmPickPlace-v0", image_size=96)
    imgs, goals, tasks = [], [], []
    for i in range(n):
        obs, info = env.reset(seed=seed + i)
        imgs.append(obs["observation.images.front"])
        goals.append(np.asarray(info["goal_pos"], np.float32)[[0, 1, 3, 4]])
        tasks.append(obs["task"])
    env.close()
    return torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(np.stack(goals)), tasks


def main(argv: list[str]) -> None:
    from tqdm import tqdm

    from robopolicy.models.encoders import EncoderConfig, VisionEncoder
    from robopolicy.models.language import LanguageConfig, LanguageEncoder

    args = dict(a.split("=", 1) for a in argv)
    film = args.get("film", "true").lower() == "true"
    pool = args.get("pool", "keypoints")
    kp_features = args.get("keypoint_features", "true").lower() == "true"
    seconds, layouts, batch = float(args.get("seconds", 300)), int(args.get("layouts", 4000)), int(args.get("batch", 64))
    torch.manual_seed(0)
    torch.set_num_threads(int(args.get("threads", 2)))
    t0 = time.perf_counter()
    x_tr, y_tr, task_tr = render_layouts(layouts, 500_000)
    x_va, y_va, task_va = render_layouts(500, 900_000)
    lang = LanguageEncoder(LanguageConfig())
    t_tr, t_va = lang.embed(task_tr), lang.embed(task_va)
    print(f"[probe] {layouts} training and 500 unseen layouts rendered in {time.perf_counter() - t0:.0f} s")
    mu, sd = y_tr.mean(0), y_tr.std(0)

    enc = VisionEncoder(EncoderConfig(name="resnet18", frozen=False, image_size=96, stage=2, film=film, pool=pool,
                                      keypoints=32, keypoint_features=kp_features), grid=6, text_dim=lang.dim if film else 0)
    head = nn.Sequential(nn.Linear(enc.n_tokens * enc.out_dim + lang.dim, 256), nn.ReLU(),
                         nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    params = list(enc.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=1e-4)

    def predict(x, t):
        z = enc(x, t if film else None).flatten(1)
        return head(torch.cat([z, t], -1))

    def val_error():
        enc.eval(), head.eval()
        with torch.no_grad():
            p = torch.cat([predict(x_va[i:i + 250], t_va[i:i + 250]) for i in range(0, len(x_va), 250)]) * sd + mu
        enc.train(), head.train()
        e = (p - y_va).view(-1, 2, 2).norm(dim=-1).mean(0) * 100
        return float(e[0]), float(e[1])

    anchor = (mu - y_va).view(-1, 2, 2).norm(dim=-1).mean(0) * 100
    start, step = time.perf_counter(), 0
    bar = tqdm(total=int(seconds), desc="probe", unit="s")
    while time.perf_counter() - start < seconds:
        idx = torch.randint(0, len(x_tr), (batch,))
        loss = F.smooth_l1_loss(predict(x_tr[idx], t_tr[idx]), (y_tr[idx] - mu) / sd)
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        bar.n = min(int(time.perf_counter() - start), int(seconds))
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}")
        if step % 200 == 0:
            cube, bowl = val_error()
            bar.write(f"[probe] step {step}: unseen layouts cube {cube:.1f} cm, bowl {bowl:.1f} cm")
    bar.close()
    cube, bowl = val_error()
    print(f"\n| encoder | steps x batch | cube error (cm) | bowl error (cm) |\n|---|---|---|---|\n"
          f"| {'FiLM' if film else 'plain'} {pool}{'' if kp_features else ' (coordinates only)'} | {step} x {batch} | {cube:.1f} | {bowl:.1f} |\n"
          f"| anchor: the training mean | — | {anchor[0]:.1f} | {anchor[1]:.1f} |")
    print(f"[probe] {step} steps in {time.perf_counter() - start:.0f} s: cube {cube:.1f} cm, bowl {bowl:.1f} cm "
          f"({cube / anchor[0]:.2f}x / {bowl / anchor[1]:.2f}x the mean-prediction anchor)")


if __name__ == "__main__":
    main(sys.argv[1:])
