"""Does a tracking policy's frozen encoder see how far the robot can drive before it hits something?

    .venv/bin/python experiments/probes/clearance_probe.py checkpoint=outputs/train/track_stage3/final
    .venv/bin/python experiments/probes/clearance_probe.py checkpoint=CKPT episodes=120 hazard_prob=0.3 train_encoder=true

Drives PersonFollow episodes with the noisy oracle and, with probability ``hazard_prob`` per step
while an obstacle or wall is within ``hazard_range``, the env's scripted push toward it
(``hazard_twist``, for up to ``hazard_steps`` steps, until the rim is 0.3 m from it), so that
many frames look at something close. For every frame it
records the **free run ahead**: how far the robot could drive straight along its heading before
its rim touches an obstacle or wall (capped at ``max_range``; what braking needs to know, and in
the camera's view), and the rim's clearance in any direction.

Then it fits ridge regressions (the penalty chosen on a validation third of the training
episodes) from three inputs to each target, trains on ``episodes`` episodes and tests on
``test_episodes`` others:

- the policy's **frozen encoder tokens** of the frame, exactly what its backbone reads;
- the same tokens **averaged over the grid** (what is left without where in the image);
- the frame's **raw pixels**, downsampled to 16 x 16 (the anchor a learned encoder should beat);

each read by the ridge fit and by a small MLP (:func:`mlp_probe`), and the training mean (what a
probe that sees nothing scores). It prints R², the mean absolute
error and, for "free run under 1 m" read off the regression at 1 m, the balanced accuracy.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from robopolicy.config import load_config  # noqa: E402


@dataclass
class ClearanceProbeConfig:
    checkpoint: str = ""
    """A tracking policy (its frozen vision encoder is probed)."""
    split: str = "dt"
    episodes: int = 80
    test_episodes: int = 30
    seed: int = 300_000
    """Episode ``e`` starts from seed ``seed + e`` (away from the training and evaluation seeds)."""
    image_size: int = 96
    noise: float = 0.3
    """The oracle's action noise (DART-style), so the robot also drives where the oracle would not."""
    hazard_prob: float = 0.2
    hazard_range: float = 2.5
    """m: a push starts only with an obstacle or wall this close to the rim."""
    hazard_steps: int = 30
    max_range: float = 3.0
    """m: free runs beyond this count as this (the camera cannot tell 3 m from 8 m anyway)."""
    near: float = 1.0
    """m: the "something close ahead" threshold of the balanced accuracy."""
    threads: int = 2
    train_encoder: bool = False
    """Also train a copy of the encoder (from the policy's weights) with an MLP on the free run ahead:
    what the frames hold for an encoder trained to see it (~1.5 min per epoch on 2 cores)."""
    encoder_epochs: int = 6


def collect(cfg: ClearanceProbeConfig, first: int, n: int):
    """``n`` episodes from seed ``cfg.seed + first``: front frames ``(N, H, W, 3)`` uint8, the free
    run ahead and the rim clearance ``(N,)``, and each frame's episode index."""
    import gymnasium as gym
    from tqdm import tqdm

    import sim_envs  # noqa: F401 - registers the envs
    from sim_envs.person_follow.geometry import free_run
    from sim_envs.person_follow.scene import ROBOT_RADIUS

    env = gym.make("robopolicy/PersonFollow-v0", split=cfg.split, image_size=cfg.image_size)
    base = env.unwrapped
    rng = np.random.default_rng(cfg.seed + first)
    frames, run, rim, episode = [], [], [], []
    for e in tqdm(range(first, first + n), desc="episodes", unit="ep"):
        obs, info = env.reset(seed=cfg.seed + e)
        oracle = base.make_oracle(noise=cfg.noise, seed=cfg.seed + e)
        oracle.reset(obs, info)
        push, term, trunc = 0, False, False
        while not (term or trunc):
            obstacles = np.asarray(info["obstacles"])[np.asarray(info["obstacle_mask"], dtype=bool)]
            frames.append(obs["observation.images.front"])
            run.append(free_run(info["robot_pose"], ROBOT_RADIUS, obstacles, float(info["room_half_extent"]), cfg.max_range)[0])
            rim.append(min(float(info["robot_clearance"]), cfg.max_range))
            episode.append(e)
            if push == 0 and info["robot_clearance"] < cfg.hazard_range and rng.random() < cfg.hazard_prob:
                push = cfg.hazard_steps
            if push and info["robot_clearance"] > 0.3:
                action, push = base.hazard_twist(info), push - 1
            else:
                action, push = oracle.act(obs, info).action, 0
            obs, _r, term, trunc, info = env.step(action)
    env.close()
    return np.stack(frames), np.array(run, np.float32), np.array(rim, np.float32), np.array(episode)


def ridge_fit(x: np.ndarray, y: np.ndarray, lam: float) -> tuple[np.ndarray, float]:
    """Weights and bias of ridge regression on standardized ``x`` (solved in the dual when N < D)."""
    xm, ym = x.mean(0), y.mean()
    xc, yc = x - xm, y - ym
    if xc.shape[0] < xc.shape[1]:
        w = xc.T @ np.linalg.solve(xc @ xc.T + lam * np.eye(len(xc)), yc)
    else:
        w = np.linalg.solve(xc.T @ xc + lam * np.eye(xc.shape[1]), xc.T @ yc)
    return w, float(ym - xm @ w)


def probe(x_tr, y_tr, ep_tr, x_te) -> np.ndarray:
    """Test predictions of the ridge fit whose penalty scores best on the last third of the
    training episodes (then refit on all of them)."""
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    x_tr, x_te = (x_tr - mu) / sd, (x_te - mu) / sd
    cut = np.quantile(np.unique(ep_tr), 2 / 3)
    fit, val = ep_tr <= cut, ep_tr > cut
    best = min((np.mean((x_tr[val] @ w + b - y_tr[val]) ** 2), lam)
               for lam in (1e0, 1e1, 1e2, 1e3, 1e4, 1e5)
               for w, b in [ridge_fit(x_tr[fit], y_tr[fit], lam * x_tr.shape[1] / 1000)])
    w, b = ridge_fit(x_tr, y_tr, best[1] * x_tr.shape[1] / 1000)
    return x_te @ w + b


def mlp_probe(x_tr, y_tr, ep_tr, x_te, epochs: int = 60, seed: int = 0) -> np.ndarray:
    """Test predictions of a two-layer MLP (256 hidden units, dropout) on standardized inputs,
    trained with Adam on all but the last third of the training episodes and taken at the epoch
    that scores best on that third: what a small non-linear reader gets out of the same input."""
    torch.manual_seed(seed)
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    xt = torch.as_tensor((x_tr - mu) / sd, dtype=torch.float32)
    xe = torch.as_tensor((x_te - mu) / sd, dtype=torch.float32)
    yt = torch.as_tensor(y_tr, dtype=torch.float32)
    cut = np.quantile(np.unique(ep_tr), 2 / 3)
    fit, val = torch.as_tensor(ep_tr <= cut), torch.as_tensor(ep_tr > cut)
    net = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(xt.shape[1], 256), torch.nn.ReLU(),
                              torch.nn.Dropout(0.2), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    best, state = float("inf"), None
    idx = torch.nonzero(fit).squeeze(1)
    for _ in range(epochs):
        net.train()
        for b in idx[torch.randperm(len(idx))].split(128):
            loss = F.mse_loss(net(xt[b]).squeeze(1), yt[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            v = F.mse_loss(net(xt[val]).squeeze(1), yt[val]).item()
        if v < best:
            best, state = v, {k: t.clone() for k, t in net.state_dict().items()}
    net.load_state_dict(state)
    with torch.no_grad():
        return net(xe).squeeze(1).numpy()


def trained_encoder_probe(vision, frames_tr, y_tr, ep_tr, frames_te, epochs: int, seed: int = 0) -> np.ndarray:
    """Test predictions of a copy of ``vision`` made trainable, with an MLP on its flattened tokens,
    trained on all but the last third of the training episodes, taken at its best epoch there."""
    import copy

    from tqdm import tqdm

    torch.manual_seed(seed)
    enc = copy.deepcopy(vision)
    for e in getattr(enc, "encoders", [enc]):
        e.cfg.frozen = False
    enc.requires_grad_(True)
    with torch.no_grad():
        d = enc(torch.from_numpy(frames_tr[:2]).permute(0, 3, 1, 2).contiguous()).flatten(1).shape[1]
    head = torch.nn.Sequential(torch.nn.Linear(d, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.Adam([*enc.parameters(), *head.parameters()], lr=3e-4)
    cut = np.quantile(np.unique(ep_tr), 2 / 3)
    fit, val = np.nonzero(ep_tr <= cut)[0], np.nonzero(ep_tr > cut)[0]
    y = torch.as_tensor(y_tr, dtype=torch.float32)

    def predict(frames: np.ndarray, rows: np.ndarray) -> torch.Tensor:
        enc.eval()
        head.eval()
        with torch.no_grad():
            return torch.cat([head(enc(torch.from_numpy(frames[b]).permute(0, 3, 1, 2).contiguous()).flatten(1)).squeeze(1)
                              for b in np.array_split(rows, max(1, len(rows) // 256))])

    best, state = float("inf"), None
    for _ in tqdm(range(epochs), desc="training an encoder copy", unit="epoch"):
        enc.train()
        head.train()
        for b in np.array_split(np.random.default_rng(seed + _).permutation(fit), max(1, len(fit) // 64)):
            pred = head(enc(torch.from_numpy(frames_tr[b]).permute(0, 3, 1, 2).contiguous()).flatten(1)).squeeze(1)
            loss = F.mse_loss(pred, y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        v = F.mse_loss(predict(frames_tr, val), y[val]).item()
        if v < best:
            best, state = v, copy.deepcopy((enc.state_dict(), head.state_dict()))
    enc.load_state_dict(state[0])
    head.load_state_dict(state[1])
    return predict(frames_te, np.arange(len(frames_te))).numpy()


def scores(pred: np.ndarray, y: np.ndarray, near: float) -> tuple[float, float, float]:
    """R², mean absolute error, balanced accuracy of ``y < near`` read as ``pred < near``."""
    r2 = 1.0 - float(np.sum((pred - y) ** 2) / np.sum((y - y.mean()) ** 2))
    close, called = y < near, pred < near
    bacc = 0.5 * (float(np.mean(called[close])) + float(np.mean(~called[~close]))) if close.any() and (~close).any() else float("nan")
    return r2, float(np.mean(np.abs(pred - y))), bacc


def main(argv: list[str]) -> int:
    from robopolicy.models.loading import load_policy

    cfg = load_config(ClearanceProbeConfig, None, argv)
    if not cfg.checkpoint:
        raise SystemExit("give checkpoint=DIR")
    torch.set_num_threads(cfg.threads)
    policy = load_policy(cfg.checkpoint)
    if getattr(policy, "vision", None) is None:
        raise SystemExit(f"{cfg.checkpoint}: the policy has no vision encoder to probe")
    tr = collect(cfg, 0, cfg.episodes)
    te = collect(cfg, cfg.episodes, cfg.test_episodes)

    def tokens(frames: np.ndarray) -> np.ndarray:
        out = []
        with torch.inference_mode():
            for i in range(0, len(frames), 256):
                imgs = torch.from_numpy(frames[i:i + 256]).permute(0, 3, 1, 2).contiguous()
                out.append(policy.encode_frames(imgs, None).float().numpy())  # (n, tokens, C)
        return np.concatenate(out)

    def pixels(frames: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255.0
        return F.interpolate(x, size=(16, 16), mode="area").flatten(1).numpy()

    tok_tr, tok_te = tokens(tr[0]), tokens(te[0])
    inputs = {f"encoder tokens ({tok_tr.shape[1]} x {tok_tr.shape[2]})": (tok_tr.reshape(len(tok_tr), -1), tok_te.reshape(len(tok_te), -1)),
              f"encoder tokens, grid mean ({tok_tr.shape[2]})": (tok_tr.mean(1), tok_te.mean(1)),
              "raw pixels 16 x 16 x 3": (pixels(tr[0]), pixels(te[0]))}
    n_close = int(np.sum(tr[1] < cfg.near)), int(np.sum(te[1] < cfg.near))
    print(f"[probe] {len(tr[0])} training frames ({n_close[0]} with a free run under {cfg.near} m), {len(te[0])} test "
          f"frames ({n_close[1]}); free run ahead median {np.median(te[1]):.2f} m, rim clearance median "
          f"{np.median(te[2]):.2f} m")
    print(f"\n| input | probe | free run ahead: R² | MAE m | balanced acc. (< {cfg.near} m) | rim clearance: R² | MAE m |"
          "\n|---|---|---:|---:|---:|---:|---:|")
    for name, (x_tr, x_te) in {"training mean (sees nothing)": (np.zeros((len(tr[0]), 1)), np.zeros((len(te[0]), 1))),
                               **inputs}.items():
        for kind, fit in [("ridge", probe), ("MLP", mlp_probe)][:1 if name.startswith("training") else 2]:
            r = scores(fit(x_tr, tr[1], tr[3], x_te), te[1], cfg.near)
            c = scores(fit(x_tr, tr[2], tr[3], x_te), te[2], cfg.near)
            print(f"| {name} | {kind} | {r[0]:.3f} | {r[1]:.3f} | {r[2]:.1%} | {c[0]:.3f} | {c[1]:.3f} |", flush=True)
    if cfg.train_encoder:
        r = scores(trained_encoder_probe(policy.vision, tr[0], tr[1], tr[3], te[0], cfg.encoder_epochs), te[1], cfg.near)
        print(f"| the encoder, trained on the free run ({cfg.encoder_epochs} epochs) | MLP | {r[0]:.3f} | {r[1]:.3f} | "
              f"{r[2]:.1%} | — | — |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
