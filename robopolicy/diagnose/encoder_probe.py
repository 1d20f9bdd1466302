"""Do an encoder's weights see our scenes? A linear probe on its frozen features.

    robopolicy diagnose encoder-probe --episodes 200
    robopolicy diagnose encoder-probe encoder.name=efficientnet_lite2 encoder.stage=3 tasks=[cube]
    robopolicy diagnose encoder-probe weights=path/to/own_weights.safetensors encoder.name=resnet18
    python -m robopolicy.diagnose.encoder_probe --episodes 200

For each task, the first frame of ``episodes`` fresh episodes is rendered and labelled from the
simulator's state:

- ``shirt``: PersonFollow (``stt``), the shirt colour of the target, the person nearest the
  image centre at the start (10 colours; other people may be in view);
- ``person``: PersonFollow (``stt``, the target alone), person or background: every other episode
  the robot is turned away (by pi +- 0.8 rad, else by up to +-0.5 rad) before one standing step,
  and the label is whether the target is visible then (the simulator's ray test);
- ``cube``: ArmPickPlace with one cube and one bowl, the cube's colour (front camera; the bowl
  has another colour).

The frames go through the encoder twice, with ``weights`` (by default the packaged ImageNet
EfficientNet-Lite0) and with a random init of the same network, both frozen; a
logistic regression on the standardised grid features is fitted on the first ``train_fraction``
of the episodes and scored on the rest. Pretrained features that are linearly more informative
than random ones are the evidence that the weights are what they claim.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from robopolicy.models.encoders import EncoderConfig

TASKS = ("shirt", "person", "cube")


@dataclass
class EncoderProbeConfig:
    """One probe run (``robopolicy diagnose encoder-probe``)."""

    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """The backbone probed (name, image_size, stage); its weights are ``weights``."""
    weights: str = "imagenet"
    """The weights probed: ``imagenet`` (packaged) or a local file; a random init is the baseline."""
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    """Which labels to probe: shirt, person (PersonFollow), cube (ArmPickPlace)."""
    episodes: int = 200
    """Frames per task (one per episode, seeds seed..seed+N-1)."""
    seed: int = 0
    image_size: int = 96
    """Rendered frame size (square)."""
    grid: int = 3
    """Features are pooled to grid x grid tokens and concatenated, so where things are is kept."""
    train_fraction: float = 0.5
    l2: float = 1.0
    """Inverse regularisation strength C of the logistic regression."""
    init_seed: int = 0
    """torch seed of the random-init baseline."""

    def __post_init__(self):
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"tasks must be a non-empty list of {list(TASKS)}, got {self.tasks}")
        if self.episodes < 8:
            raise ValueError(f"episodes must be >= 8, got {self.episodes}")
        if not 0.1 <= self.train_fraction <= 0.9:
            raise ValueError(f"train_fraction must be in [0.1, 0.9], got {self.train_fraction}")
        if self.encoder.weights:
            raise ValueError("set the probed weights with weights=..., not encoder.weights")
        if not self.weights:
            raise ValueError("weights is empty: the probe compares pretrained weights with a random init")


def render_frames(task: str, episodes: int, seed: int, image_size: int, progress: bool = False):
    """``(N, H, W, 3)`` uint8 first frames and their ``(N,)`` string labels."""
    import gymnasium

    from sim_envs.registration import register_envs

    register_envs()
    if task == "shirt":
        env = gymnasium.make("robopolicy/PersonFollow-v0", split="stt", image_size=image_size)
    elif task == "person":
        env = gymnasium.make("robopolicy/PersonFollow-v0", split="stt", image_size=image_size, num_others=0)
    else:
        env = gymnasium.make("robopolicy/ArmPickPlace-v0", image_size=image_size, num_cubes=1, num_bowls=1)
    frames, labels = [], []
    try:
        for i in range(episodes):
            obs, info = env.reset(seed=seed + i)
            if task == "person":
                obs, info = _turned(env, i, np.random.default_rng(seed + i))
            frames.append(obs["observation.images.front"])
            if task == "shirt":
                labels.append(env.unwrapped.scenario.people[0].shirt)
            elif task == "person":
                labels.append("person" if info["target_visible"] else "background")
            else:
                labels.append(info["cube_colors"][0])
            if progress and (i + 1) % 50 == 0:
                print(f"[probe] {task}: {i + 1}/{episodes} frames")
    finally:
        env.close()
    return np.stack(frames), np.asarray(labels)


def _turned(env, i: int, rng: np.random.Generator):
    """Turn a freshly reset PersonFollow robot (away from the target on odd ``i``) and take one
    standing step; returns that step's observation and info."""
    state = env.unwrapped.get_state()
    turn = math.pi + rng.uniform(-0.8, 0.8) if i % 2 else rng.uniform(-0.5, 0.5)
    robot = np.array(state["_robot"], dtype=np.float64)
    robot[2] += turn
    state["_robot"] = robot.astype(np.asarray(state["_robot"]).dtype)
    env.unwrapped.set_state(state)
    obs, _reward, _terminated, _truncated, info = env.step(np.zeros(2, np.float32))
    return obs, info


def encode(encoder_cfg: EncoderConfig, frames: np.ndarray, grid: int, batch: int = 32) -> np.ndarray:
    """Frozen features of uint8 frames ``(N, H, W, 3)`` → ``(N, grid * grid * C)`` float32."""
    import torch

    from robopolicy.models.encoders import VisionEncoder

    enc = VisionEncoder(dataclasses.replace(encoder_cfg, frozen=True), grid=grid)
    out = []
    with torch.inference_mode():
        for i in range(0, len(frames), batch):
            x = torch.from_numpy(frames[i:i + batch]).permute(0, 3, 1, 2).contiguous()
            out.append(enc(x).flatten(1).float().numpy())
    return np.concatenate(out)


def probe_accuracy(features: np.ndarray, labels: np.ndarray, n_train: int, l2: float) -> float:
    """Test accuracy of a multinomial logistic regression fitted on the first ``n_train`` rows."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    clf = make_pipeline(StandardScaler(), LogisticRegression(C=l2, max_iter=2000))
    clf.fit(features[:n_train], labels[:n_train])
    return float((clf.predict(features[n_train:]) == labels[n_train:]).mean())


def diagnose(cfg: EncoderProbeConfig, progress: bool = True) -> dict:
    """Probe every task with the configured weights and with a random init; JSON-ready result."""
    import torch

    random_cfg = dataclasses.replace(cfg.encoder, weights=None)
    pretrained_cfg = dataclasses.replace(cfg.encoder, weights=cfg.weights)
    rows = []
    for task in cfg.tasks:
        t0 = time.perf_counter()
        frames, labels = render_frames(task, cfg.episodes, cfg.seed, cfg.image_size, progress)
        n_train = int(round(cfg.train_fraction * len(labels)))
        test = labels[n_train:]
        values, counts = np.unique(labels[:n_train], return_counts=True)
        majority = float((test == values[counts.argmax()]).mean())
        torch.manual_seed(cfg.init_seed)
        acc_random = probe_accuracy(encode(random_cfg, frames, cfg.grid), labels, n_train, cfg.l2)
        acc_pretrained = probe_accuracy(encode(pretrained_cfg, frames, cfg.grid), labels, n_train, cfg.l2)
        rows.append({"task": task, "classes": int(len(np.unique(labels))), "train": n_train,
                     "test": int(len(test)), "majority": majority, "random": acc_random,
                     "pretrained": acc_pretrained, "seconds": time.perf_counter() - t0})
    enc = cfg.encoder
    return {"encoder": f"{enc.name}@{enc.image_size}" + (f"/s{enc.stage}" if enc.stage is not None else ""),
            "weights": cfg.weights, "episodes": cfg.episodes, "rows": rows}


def report(result: dict) -> list[str]:
    """The printed table and a one-line summary."""
    lines = [f"linear probe on frozen {result['encoder']} features: weights {result['weights']} against a random init",
             "", "| task | classes | train / test | majority | random init | pretrained |",
             "|------|---------|--------------|----------|-------------|------------|"]
    for r in result["rows"]:
        lines.append(f"| {r['task']} | {r['classes']} | {r['train']} / {r['test']} | {r['majority']:.1%} | "
                     f"{r['random']:.1%} | {r['pretrained']:.1%} |")
    lines.append("")
    lines.append("probe: " + ", ".join(f"{r['task']} {r['pretrained']:.1%} pretrained vs {r['random']:.1%} random"
                                       for r in result["rows"]))
    return lines


def metrics(result: dict) -> dict:
    """The run record's metrics: test accuracy per task, pretrained and random."""
    return {f"{r['task']}_{kind}": r[kind] for r in result["rows"] for kind in ("pretrained", "random", "majority")}


def main(argv: list[str] | None = None) -> int:
    """``python -m robopolicy.diagnose.encoder_probe [--episodes N] [--out DIR] [key=value ...]``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m robopolicy.diagnose.encoder_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", help="also write <out>/encoder-probe.json and <out>/summary.json")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    from robopolicy.cli import main as cli_main

    flags = [f"--{k}={getattr(args, k)}" for k in ("episodes", "seed", "out") if getattr(args, k) is not None]
    return cli_main(["diagnose", "encoder-probe", *flags, *args.overrides])


if __name__ == "__main__":
    raise SystemExit(main())
