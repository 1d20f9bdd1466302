"""Ours vs LeRobot's ACT and Diffusion Policy on the same arm dataset, at equal wall clock.

    .venv/bin/python bench/vs_lerobot.py                                   # defaults below
    .venv/bin/python bench/vs_lerobot.py budget_s=600 demos=200 episodes=50
    .venv/bin/python bench/vs_lerobot.py policies=[ours,act] budget_s=120 episodes=4   # a quick look
    # ours, the camera student of distillation and ACT on the same two cameras, three repeats (one a run):
    for r in 0 1 2; do .venv/bin/python bench/vs_lerobot.py "policies=[ours,student,act]" camera=front+wrist \
        demos=20 budget_s=120 episodes=2 repeat=$r out=outputs/bench/vs_lerobot_student; done
    .venv/bin/python bench/vs_lerobot.py "policies=[ours,act]" camera=none demos=200 episodes=50 \
        dataset=outputs/datasets/arm_pp_state "env={id: robopolicy/ArmPickPlace-v0, kwargs: {use_cameras: false, env_state: true}}"
    .venv/bin/python bench/vs_lerobot.py "policies=[ours,act]" camera=front+wrist recipe=configs/train/arm/reach_cam.yaml \
        "env={id: robopolicy/ArmReach-v0, kwargs: {}}" demos=1000 dataset=outputs/datasets/arm_reach_cam budget_s=1200 episodes=100
    # the same with bf16 autocast for ours (a CPU with AVX512-BF16), and then for ACT too:
    .venv/bin/python bench/vs_lerobot.py ... "ours={amp: bf16}"          # ... as the previous command
    .venv/bin/python bench/vs_lerobot.py ... "ours={amp: bf16}" lerobot_amp=bf16

1. Dataset: ``demos`` oracle episodes of ``env`` collected with ``robopolicy collect`` (reused
   when ``dataset`` already holds them). The cameras of ``camera`` (one name, or several joined by
   ``+``: ``front+wrist``) at ``image_size`` px + the state;
   or, with ``camera=none``, no camera: every policy reads the joint state and the scene state
   (``observation.environment_state``, LeRobot's key; the env needs ``env_state: true``).
2. Training, ``budget_s`` of wall clock each (set-up, data loading and feature encoding
   included), batch ``batch_size``; samples/s is the steady rate after the warm-up steps:
   - ACT and Diffusion with lerobot's own code: ``ACTConfig`` / ``DiffusionConfig`` (lerobot's
     defaults, no pretrained weights, no hub), ``make_*_pre_post_processors`` with the dataset's
     statistics, ``LeRobotDataset`` with the policy's ``delta_timestamps`` (video decoding
     included), the policy's optimizer preset and gradient clipping. The learning-rate
     schedulers are left out (a budget has no known step count). ``lerobot_amp=bf16`` runs
     their forward pass under bf16 autocast, as ``ours={amp: bf16}`` runs ours.
   - Ours with ``robopolicy.train`` and ``recipe``, one of our train configs (its model, losses,
     optimizer, augmentation; by default the shipped arm recipe ``configs/train/arm/chunk_l1.yaml``,
     the packaged ImageNet EfficientNet-Lite0 frozen, without language since ACT reads no
     instruction), trained on the same dataset, cameras and batch size. The frozen encoder's
     feature cache is built in the budget (the encoding counts) unless an earlier run left it.
   - ``student``: the camera student of ``robopolicy refine --method distill``
     (``student_recipe``, with its instruction), trained the same way; its latency at batch 1 on
     the same frames is the figure that matters.
3. Evaluation in our env, the same seeds for all (``robopolicy.eval``); lerobot's policies run
   through their own ``select_action`` (their action queues decide the chunk execution).
4. Latency per chunk at batch 1 on the CPU (wall clock and CPU time), same image size, the same frames (one env
   observation): ACT ``predict_action_chunk``, Diffusion one chunk generation, ours ``predict``
   (encoder and instruction included).

Prints one table plus ratios against ACT and writes ``<out>/repeat_<repeat>/vs_lerobot.json``.
``repeat`` numbers independent runs of the same settings (training seed ``repeat``, the same eval
seeds), one a process so that each fits its time; every run writes ``<out>/summary.json`` over the
repeats present so far: the median of each figure, the ratios of the medians, every repeat's
numbers and the load average around each.
Goals (issue 4): our latency <= 0.25x ACT's, our training samples/s >= 10x ACT's, our success >= ACT's.
Goal (issue 53): the camera student's batch-1 latency on the CPU <= 0.25x ACT's on the same frames.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from robopolicy.config import deep_merge, load_config, load_yaml  # noqa: E402
from robopolicy.envs import EnvConfig  # noqa: E402
from robopolicy.utils.records import write_summary  # noqa: E402

WARMUP_STEPS = 5
DEFAULT_RECIPE = "configs/train/arm/chunk_l1.yaml"
STUDENT_RECIPE = "configs/train/arm/distill_student.yaml"
OURS = ("ours", "student")


@dataclass
class BenchConfig:
    env: EnvConfig = field(default_factory=lambda: EnvConfig(
        "robopolicy/ArmPickPlace-v0", {"num_cubes": 1, "num_bowls": 1}))
    """Single-task by default: lerobot's ACT and Diffusion take no instruction."""
    dataset: str = "outputs/bench/vs_lerobot/dataset"
    demos: int = 50
    collect_workers: int = 2
    image_size: int = 96
    camera: str = "front"
    """The camera(s) every policy sees (``front``, ``front+wrist``); ``none``: a state-based
    comparison (see 1. above)."""
    recipe: str | None = None
    """A train config of ours (e.g. ``configs/train/arm/reach_cam.yaml``) to train as ``ours``;
    None: ``configs/train/arm/chunk_l1.yaml`` without language (with ``camera=none``, the state
    recipe below). The bench sets its dataset, cameras, batch size, steps and output."""
    student_recipe: str = STUDENT_RECIPE
    """The train config of the policy ``student`` (the camera student of distillation)."""
    policies: list[str] = field(default_factory=lambda: ["ours", "act", "diffusion"])
    """Any of ``ours``, ``student``, ``act``, ``diffusion``."""
    repeat: int = 0
    """Which repeat this run is (training seed; ``<out>/repeat_<repeat>/``)."""
    budget_s: float = 300.0
    """Training wall clock per policy (data loading / feature encoding included)."""
    batch_size: int = 8
    loader_workers: int = 1
    """DataLoader processes decoding video for the lerobot policies."""
    lerobot_amp: str = "none"
    """``bf16``: train the lerobot policies under the same bf16 autocast that ``ours={amp: bf16}``
    gives ours, for a like-for-like samples/s; ``none`` (default): lerobot's float32 defaults."""
    episodes: int = 10
    eval_workers: int = 2
    seed: int = 100_000
    diffusion_eval_episodes: int | None = 2
    """Diffusion generates each chunk with 100 denoising steps (seconds on a CPU): evaluate it on
    fewer episodes (the first seeds of the same list); ``None``: all ``episodes``."""
    diffusion_inference_steps: int | None = None
    """Denoising steps per Diffusion chunk at inference; ``None``: lerobot's default (100)."""
    latency_repeats: int = 5
    ours: dict[str, Any] = field(default_factory=dict)
    """Overrides of the ``TrainConfig`` of ``ours`` (not ``student``), e.g. ``{model: {horizon: 16}}``."""
    threads: int = 2
    out: str = "outputs/bench/vs_lerobot"


# --------------------------------------------------------------------------- dataset
def ensure_dataset(cfg: BenchConfig) -> Path:
    """Collect ``cfg.demos`` oracle episodes unless the dataset already holds them."""
    from robopolicy.data.collect import CollectConfig, collect
    from robopolicy.data.recorder import read_info

    root = Path(cfg.dataset)
    have = int(read_info(root)["total_episodes"]) if (root / "meta" / "info.json").is_file() else 0
    if have >= cfg.demos:
        print(f"[bench] dataset {root}: {have} episodes (reused)")
        return root
    print(f"[bench] collecting {cfg.demos} oracle episodes of {cfg.env.label()} -> {root}")
    summary = collect(CollectConfig(env=cfg.env, episodes=cfg.demos, workers=cfg.collect_workers, noise=0.1, seed=0,
                                    out=str(root), resume=have > 0, image_size=cfg.image_size, vcodec="h264",
                                    progress=False))
    print(summary.table())
    return root


# --------------------------------------------------------------------------- lerobot side
def camera_names(camera: str) -> list[str]:
    """``front+wrist`` -> ``[front, wrist]``; ``none`` -> ``[]``."""
    if camera == "none":
        return []
    names = [c.strip() for c in camera.split("+")]
    if not all(names):
        raise ValueError(f"camera {camera!r}: expected names joined by '+', e.g. front+wrist, or none")
    return names


def lerobot_parts(kind: str, root: Path, camera: str, diffusion_inference_steps: int | None = None):
    """(config, policy, preprocessor, postprocessor, metadata) built with lerobot's own factories."""
    from lerobot.configs.types import FeatureType
    from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata
    from lerobot.datasets.utils import dataset_to_policy_features

    meta = LeRobotDatasetMetadata("local/vs_lerobot", root=root)
    features = dataset_to_policy_features(meta.features)
    wanted = ("observation.state", "observation.environment_state") if camera == "none" else \
        (*(f"observation.images.{c}" for c in camera_names(camera)), "observation.state")
    missing = [k for k in wanted if k not in features]
    if missing:
        raise ValueError(f"dataset {root} has no {missing} (it has {sorted(features)})")
    inputs = {k: f for k, f in features.items() if k in wanted}
    outputs = {k: f for k, f in features.items() if k == "action" and f.type is FeatureType.ACTION}
    if kind == "act":
        from lerobot.policies.act.configuration_act import ACTConfig
        from lerobot.policies.act.modeling_act import ACTPolicy
        from lerobot.policies.act.processor_act import make_act_pre_post_processors

        config = ACTConfig(input_features=inputs, output_features=outputs, pretrained_backbone_weights=None,
                           device="cpu", push_to_hub=False)
        policy = ACTPolicy(config)
        pre, post = make_act_pre_post_processors(config, dataset_stats=meta.stats)
    elif kind == "diffusion":
        from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
        from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
        from lerobot.policies.diffusion.processor_diffusion import make_diffusion_pre_post_processors

        config = DiffusionConfig(input_features=inputs, output_features=outputs, pretrained_backbone_weights=None,
                                 device="cpu", push_to_hub=False, num_inference_steps=diffusion_inference_steps)
        policy = DiffusionPolicy(config)
        pre, post = make_diffusion_pre_post_processors(config, dataset_stats=meta.stats)
    else:
        raise ValueError(f"unknown lerobot policy {kind!r}")
    return config, policy, pre, post, meta


def train_lerobot(kind: str, cfg: BenchConfig, root: Path) -> dict[str, Any]:
    """Train for ``cfg.budget_s`` seconds of wall clock; returns the policy and its numbers."""
    from lerobot.datasets.factory import resolve_delta_timestamps
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    t_start = time.perf_counter()
    config, policy, pre, post, meta = lerobot_parts(kind, root, cfg.camera, cfg.diffusion_inference_steps)
    dataset = LeRobotDataset("local/vs_lerobot", root=root, delta_timestamps=resolve_delta_timestamps(config, meta),
                             video_backend="pyav")
    loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, drop_last=True,
                                         num_workers=cfg.loader_workers,
                                         persistent_workers=cfg.loader_workers > 0)
    preset = config.get_optimizer_preset()
    optimizer = preset.build(policy.get_optim_params())
    clip = float(getattr(preset, "grad_clip_norm", 10.0))
    policy.train()
    steps = samples = 0
    losses: list[float] = []
    t_train = time.perf_counter()
    t_steady, steady_from = None, WARMUP_STEPS  # samples/s is measured after the warm-up steps
    while time.perf_counter() - t_start < cfg.budget_s:
        for batch in loader:
            batch = pre(batch)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.lerobot_amp == "bf16"):
                loss, _ = policy.forward(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), clip)
            optimizer.step()
            steps += 1
            samples += cfg.batch_size
            losses.append(float(loss.detach()))
            if steps == steady_from:
                t_steady = time.perf_counter()
            if steps % 10 == 0:
                print(f"[bench] {kind}: step {steps}, loss {np.mean(losses[-10:]):.4f}, "
                      f"{samples / (time.perf_counter() - t_train):.1f} samples/s", flush=True)
            if time.perf_counter() - t_start >= cfg.budget_s:
                break
    now = time.perf_counter()
    seconds = now - t_train
    if t_steady is not None and steps > steady_from:
        rate = (steps - steady_from) * cfg.batch_size / (now - t_steady)
    else:  # too few steps for a steady state: the whole run, warm-up included
        rate = samples / seconds if seconds > 0 else 0.0
    del loader, dataset  # stops the persistent decoding workers
    policy.eval()
    return {"policy": policy, "pre": pre, "post": post, "config": config, "steps": steps, "samples": samples,
            "train_seconds": seconds, "wall_seconds": time.perf_counter() - t_start, "samples_per_s": rate,
            "first_loss": losses[0] if losses else None, "last_loss": float(np.mean(losses[-10:])) if losses else None,
            "params": sum(p.numel() for p in policy.parameters())}


class LerobotEvalPolicy:
    """A lerobot policy behind robopolicy's eval interface: one action per call, ``(B, 1, A)``;
    lerobot's own action queue decides when a new chunk is generated."""

    kind = "action"

    def __init__(self, policy, pre, post, camera: str):
        self.policy, self.pre, self.post, self.camera = policy, pre, post, camera

    def reset(self) -> None:
        self.policy.reset()

    @torch.inference_mode()
    def predict(self, obs: dict[str, Any]) -> torch.Tensor:
        action = self.post(self.policy.select_action(self.pre(lerobot_batch(obs, self.camera))))
        return action[:, None]


def lerobot_batch(obs: dict[str, Any], camera: str) -> dict[str, Any]:
    """Our policy batch → what lerobot's preprocessors take (images as floats in [0, 1])."""
    batch = {"observation.state": obs["observation.state"].float(), "task": list(obs["task"])}
    if camera == "none":
        batch["observation.environment_state"] = obs["observation.environment_state"].float()
    else:
        for c in camera_names(camera):
            key = f"observation.images.{c}"
            batch[key] = obs[key].float() / 255.0
    return batch


# --------------------------------------------------------------------------- our side
def steady_rate(metrics_csv: Path, fallback: float) -> float:
    """Median ``samples_per_s`` of the trainer's log intervals after the first (warm-up) one."""
    import csv

    if not metrics_csv.is_file():
        return fallback
    with open(metrics_csv) as f:
        rates = [float(row["samples_per_s"]) for row in csv.DictReader(f) if row.get("samples_per_s")]
    return statistics.median(rates[1:]) if len(rates) > 1 else fallback


def ours_recipe(cfg: BenchConfig, name: str) -> dict[str, Any]:
    """The train config (as a mapping) of our policy ``name`` on the bench's data, cameras and batch."""
    base = {
        "name": f"vs_lerobot_{name}", "out": str(run_dir(cfg) / name), "overwrite": True, "progress": False,
        "batch_size": cfg.batch_size, "save_every": 0, "log_every": 20, "threads": cfg.threads, "seed": cfg.repeat,
        "data": {"dataset": str(cfg.dataset), "features": {"cameras": camera_names(cfg.camera)}},
    }
    if name == "student":
        path, tweak = cfg.student_recipe, {}
    elif cfg.recipe:
        path, tweak = cfg.recipe, {}
    elif cfg.camera == "none":  # the shipped state recipe (configs/train/arm/state_chunk.yaml) without language
        base["data"]["features"] = {"cameras": [], "env_state": "observation.environment_state"}
        base["model"] = {"head": "chunk_l1", "horizon": 16, "context_strides": [0], "language": {"enabled": False},
                         "d_model": 128, "n_heads": 4, "n_layers": 3, "head_layers": 2}
        return deep_merge(base, cfg.ours)
    else:  # the shipped arm recipe without language: lerobot's ACT reads no instruction
        path, tweak = DEFAULT_RECIPE, {"model": {"language": {"enabled": False}}}
    recipe = {k: v for k, v in load_yaml(path).items() if k not in ("name", "out", "steps", "save_every", "init_from")}
    if cfg.camera == "none":
        recipe.setdefault("data", {}).setdefault("features", {})["env_state"] = "observation.environment_state"
    return deep_merge(deep_merge(deep_merge(recipe, tweak), base), cfg.ours if name == "ours" else {})


def train_ours(cfg: BenchConfig, root: Path, name: str = "ours") -> dict[str, Any]:
    """Our chunk policy for the same wall clock: a short calibration run sets the step count."""
    from robopolicy.config import build, to_dict
    from robopolicy.models.policy import Policy
    from robopolicy.train import TrainConfig, train

    data = deep_merge(ours_recipe(cfg, name), {"data": {"dataset": str(root)}})
    t_start = time.perf_counter()
    calib = build(TrainConfig, deep_merge(data, {"steps": 30, "log_every": 10, "out": data["out"] + "_calib"}),
                  "<bench ours calibration>")
    c = train(calib, log=lambda m: None)
    spent = time.perf_counter() - t_start
    steps = max(10, int((cfg.budget_s - spent) * c.samples_per_s / cfg.batch_size * 0.95))
    run = build(TrainConfig, deep_merge(data, {"steps": steps}), "<bench ours>")
    r = train(run, log=lambda m: print(m, flush=True))
    policy = Policy.load(r.final)
    policy.eval()
    return {"policy": policy, "steps": r.steps, "samples": r.steps * cfg.batch_size, "train_seconds": r.seconds,
            "wall_seconds": time.perf_counter() - t_start, "samples_per_s": steady_rate(r.out / "metrics.csv", r.samples_per_s),
            "feature_seconds": c.feature_seconds + r.feature_seconds,
            "first_loss": r.first_losses.get("total"), "last_loss": r.last_losses.get("total"),
            "params": sum(p.numel() for p in policy.parameters()),
            "trainable_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
            "encoders": [e.get("name") for e in data.get("model", {}).get("encoders", [])],
            "weights": [e.get("weights") for e in data.get("model", {}).get("encoders", [])],
            "config": to_dict(run)}


# --------------------------------------------------------------------------- measurements
def sample_observation(cfg: BenchConfig) -> dict[str, Any]:
    """One env observation as a batch of 1: uint8 images (1, 3, H, W), state (1, D), task."""
    from robopolicy.eval.policy_runner import to_policy_batch
    from robopolicy.envs import make_env

    kwargs = {**cfg.env.kwargs, **({} if cfg.camera == "none" else {"image_size": cfg.image_size})}
    env = make_env(EnvConfig(cfg.env.id, kwargs), render_mode=None)
    obs, _ = env.reset(seed=cfg.seed)
    env.close()
    batched = {k: (np.asarray(v)[None] if k != "task" else [v]) for k, v in obs.items()}
    return to_policy_batch(batched)


def chunk_latency_ms(name: str, entry: dict[str, Any], obs: dict[str, Any], repeats: int,
                     warmup: int = 3) -> tuple[float, float]:
    """Median milliseconds to produce one chunk at batch 1, wall clock and this process's CPU time,
    after ``warmup`` untimed calls (the first calls at a new input shape are several times slower on
    a CPU). On a machine shared with other work the CPU time is the steadier of the two."""
    times, cpu = [], []
    with torch.inference_mode():
        for i in range(repeats + warmup):
            if name in OURS:
                policy = entry["policy"]
                policy.reset()
                t, c = time.perf_counter(), time.process_time()
                policy.predict(obs)
            else:
                policy, pre, camera = entry["policy"], entry["pre"], entry["camera"]
                batch = pre(lerobot_batch(obs, camera))
                policy.reset()
                t, c = time.perf_counter(), time.process_time()
                if name == "act":
                    policy.predict_action_chunk(batch)
                else:
                    policy.select_action(batch)  # an empty queue: generates one chunk
            if i >= warmup:
                times.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
    return 1000.0 * statistics.median(times), 1000.0 * statistics.median(cpu)


def evaluate_policy(name: str, entry: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    from robopolicy.eval import ChunkConfig, EvalConfig, evaluate

    episodes = cfg.episodes
    if name == "diffusion" and cfg.diffusion_eval_episodes is not None:
        episodes = min(episodes, cfg.diffusion_eval_episodes)
    if name in OURS:
        policy, chunk = entry["policy"], ChunkConfig(mode="chunk", steps_per_chunk=8)
    else:
        policy = LerobotEvalPolicy(entry["policy"], entry["pre"], entry["post"], cfg.camera)
        chunk = ChunkConfig(mode="chunk", steps_per_chunk=1)
    ecfg = EvalConfig(env=cfg.env, episodes=episodes, workers=min(cfg.eval_workers, episodes), seed=cfg.seed,
                      image_size=None if cfg.camera == "none" else cfg.image_size, chunk=chunk, videos=1, out=str(run_dir(cfg) / f"eval_{name}"),
                      checkpoint=name)
    report = evaluate(policy, ecfg)
    return report.splits[0].summary


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "—"
    return f"{a / b:.2f}x"


def run_dir(cfg: BenchConfig) -> Path:
    """Where repeat ``cfg.repeat`` keeps its checkpoints, evaluations and numbers."""
    return Path(cfg.out) / f"repeat_{cfg.repeat}"


def settings(cfg: BenchConfig) -> dict[str, Any]:
    """What every repeat of one comparison shares (the config but the repeat index)."""
    return {k: v for k, v in vars(cfg).items() if k not in ("env", "repeat")} | {"env": vars(cfg.env)}


def repeat_table(rows: dict[str, dict[str, Any]]) -> str:
    """One repeat as a markdown table, ratios against ACT."""
    act = rows.get("act", {})
    head = ["policy", "params M", "train steps", "samples/s", "ms/chunk (B=1)", "CPU ms/chunk", "episodes", "success %",
            "samples/s vs ACT", "latency vs ACT"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        ev = r["eval"]
        lines.append("| " + " | ".join([
            name, f"{r['params'] / 1e6:.1f}", str(r["steps"]), f"{r['samples_per_s']:.1f}", f"{r['latency_ms']:.1f}",
            f"{r['latency_cpu_ms']:.1f}", str(ev.get("episodes")), f"{100 * ev.get('success_rate', 0.0):.0f}",
            _ratio(r["samples_per_s"], act.get("samples_per_s")), _ratio(r["latency_ms"], act.get("latency_ms")),
        ]) + " |")
    return "\n".join(lines)


def read_repeats(cfg: BenchConfig) -> list[dict[str, Any]]:
    """The repeats under ``cfg.out`` run with the same settings as this one, by repeat index."""
    found, same = [], json.loads(json.dumps(settings(cfg), default=str))  # as vs_lerobot.json holds them
    for path in sorted(Path(cfg.out).glob("repeat_*/vs_lerobot.json")):
        saved = json.loads(path.read_text())
        if saved.get("config") != same:
            print(f"[bench] {path}: other settings, left out of the summary")
            continue
        found.append(saved)
    return sorted(found, key=lambda r: r["repeat"])


def summarise(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats: each policy's samples/s and latency, and the ratios against ACT
    (the median of the per-repeat ratios: ours and ACT of one repeat ran under the same load)."""
    metrics: dict[str, Any] = {"repeats": len(repeats), "load_average": [r["load_average"] for r in repeats]}
    names = [n for n in repeats[0]["results"] if all(n in r["results"] for r in repeats)]
    for name in names:
        runs = [r["results"][name] for r in repeats]
        wins = sum(round(x["eval"].get("success_rate", 0.0) * x["eval"].get("episodes", 0)) for x in runs)
        episodes = sum(int(x["eval"].get("episodes", 0)) for x in runs)
        metrics[f"{name}_samples_per_s"] = round(statistics.median(x["samples_per_s"] for x in runs), 2)
        metrics[f"{name}_ms_per_chunk"] = round(statistics.median(x["latency_ms"] for x in runs), 2)
        metrics[f"{name}_cpu_ms_per_chunk"] = round(statistics.median(x["latency_cpu_ms"] for x in runs), 2)
        metrics[f"{name}_success"] = f"{wins} of {episodes}"
        metrics[f"{name}_params_m"] = round(runs[0]["params"] / 1e6, 2)
        metrics[name] = {"samples_per_s": [x["samples_per_s"] for x in runs], "ms_per_chunk": [x["latency_ms"] for x in runs],
                         "cpu_ms_per_chunk": [x["latency_cpu_ms"] for x in runs],
                         "steps": [x["steps"] for x in runs], "success_rate": [x["eval"].get("success_rate") for x in runs],
                         **{k: runs[0][k] for k in ("encoders", "weights", "trainable_params") if k in runs[0]}}
        if name != "act" and "act" in names:
            speed = [x["samples_per_s"] / r["results"]["act"]["samples_per_s"] for x, r in zip(runs, repeats)]
            latency = [x["latency_ms"] / r["results"]["act"]["latency_ms"] for x, r in zip(runs, repeats)]
            cpu = [x["latency_cpu_ms"] / r["results"]["act"]["latency_cpu_ms"] for x, r in zip(runs, repeats)]
            prefix = "" if name == "ours" else f"{name}_"
            metrics[f"{prefix}samples_per_s_ratio"] = round(statistics.median(speed), 2)
            metrics[f"{prefix}latency_ratio"] = round(statistics.median(latency), 3)
            metrics[f"{prefix}latency_cpu_ratio"] = round(statistics.median(cpu), 3)
            metrics[name] |= {"samples_per_s_ratio": [round(v, 3) for v in speed], "latency_ratio": [round(v, 4) for v in latency],
                              "latency_cpu_ratio": [round(v, 4) for v in cpu]}
    return metrics


def main(argv: list[str]) -> int:
    started = time.time()
    cfg = load_config(BenchConfig, None, argv)
    if cfg.lerobot_amp not in ("none", "bf16"):
        raise SystemExit(f"lerobot_amp must be 'none' or 'bf16', got {cfg.lerobot_amp!r}")
    unknown = [p for p in cfg.policies if p not in (*OURS, "act", "diffusion")]
    if unknown:
        raise SystemExit(f"policies: unknown {unknown}; expected any of ours, student, act, diffusion")
    torch.set_num_threads(cfg.threads)
    out = run_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    root = ensure_dataset(cfg)
    obs = sample_observation(cfg)
    load_before = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    for name in cfg.policies:
        print(f"\n[bench] === {name}: training for {cfg.budget_s:.0f} s ===", flush=True)
        torch.manual_seed(cfg.repeat)
        entry = train_ours(cfg, root, name) if name in OURS else train_lerobot(name, cfg, root)
        entry["camera"] = cfg.camera
        slow = name == "diffusion"  # seconds per chunk: one warm-up, one timed call
        entry["latency_ms"], entry["latency_cpu_ms"] = chunk_latency_ms(name, entry, obs, 1 if slow else cfg.latency_repeats, 1 if slow else 3)
        print(f"[bench] {name}: {entry['params'] / 1e6:.1f} M params, {entry['samples_per_s']:.1f} samples/s, "
              f"{entry['latency_ms']:.1f} ms per chunk ({entry['latency_cpu_ms']:.1f} ms CPU)", flush=True)
        entry["eval"] = evaluate_policy(name, entry, cfg)
        rows[name] = {k: v for k, v in entry.items() if k not in ("policy", "pre", "post", "config")}
    load_after = os.getloadavg()

    table = repeat_table(rows)
    seen = "no camera (joint + scene state)" if cfg.camera == "none" else \
        f"{cfg.image_size}px camera(s) {'+'.join(camera_names(cfg.camera))}"
    seen += f", ours: {cfg.recipe or DEFAULT_RECIPE}"
    amp_ours = cfg.ours.get("amp") or (load_yaml(cfg.recipe).get("amp") if cfg.recipe else None) or "none"
    seen += f", autocast: ours {amp_ours}, lerobot {cfg.lerobot_amp}"
    print(f"\n{cfg.env.label()}, {cfg.demos} demos, {seen}, "
          f"{cfg.budget_s:.0f} s of training each, batch {cfg.batch_size}, {torch.get_num_threads()} CPU threads, "
          f"repeat {cfg.repeat}, load average {load_before[0]:.1f} -> {load_after[0]:.1f}\n")
    print(table)
    (out / "vs_lerobot.json").write_text(json.dumps({
        "config": settings(cfg), "repeat": cfg.repeat, "started_at": started, "wall_time_s": time.time() - started,
        "load_average": {"before": [round(v, 2) for v in load_before], "after": [round(v, 2) for v in load_after]},
        "results": rows, "table": table}, indent=2, default=str) + "\n")

    repeats = read_repeats(cfg)
    metrics = summarise(repeats)
    print(f"\nover {len(repeats)} repeat(s), medians:")
    for name in (n for n in OURS if f"{n}_ms_per_chunk" in metrics and "act_ms_per_chunk" in metrics):
        prefix = "" if name == "ours" else f"{name}_"
        print(f"  {name}: latency {metrics[f'{prefix}latency_ratio']:.3f}x ACT (goal <= 0.25; "
              f"{metrics[f'{name}_ms_per_chunk']:.1f} vs {metrics['act_ms_per_chunk']:.1f} ms), "
              f"CPU time {metrics[f'{prefix}latency_cpu_ratio']:.3f}x ACT "
              f"({metrics[f'{name}_cpu_ms_per_chunk']:.1f} vs {metrics['act_cpu_ms_per_chunk']:.1f} ms), "
              f"samples/s {metrics[f'{prefix}samples_per_s_ratio']:.1f}x ACT "
              f"({metrics[f'{name}_samples_per_s']:.1f} vs {metrics['act_samples_per_s']:.1f}), "
              f"success {metrics[f'{name}_success']} vs ACT {metrics['act_success']}")
    write_summary(Path(cfg.out), kind="bench", config=settings(cfg), seeds=[cfg.seed], episodes=cfg.episodes,
                  started_at=min(r["started_at"] for r in repeats),
                  wall_time_s=sum(r["wall_time_s"] for r in repeats),
                  extra={"bench": "vs_lerobot", "repeats": [r["repeat"] for r in repeats]}, metrics=metrics)
    print(f"\nresults: {out / 'vs_lerobot.json'}, {Path(cfg.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
