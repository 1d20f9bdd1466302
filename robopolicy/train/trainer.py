"""Imitation training of a :class:`~robopolicy.models.policy.Policy`, one config per recipe/stage.

    cfg = load_config(TrainConfig, "configs/train/arm/chunk_l1.yaml", ["steps=200"])
    result = train(cfg)             # -> result.final: the checkpoint directory to evaluate

Recipe = a dataset (any LeRobot v3.0 dataset; ``data.features`` maps its keys to roles), a model
config, loss weights and an optional ``init_from`` (the previous stage's checkpoint). Losses:

- ``action``: the head's imitation loss (L1 waypoints / L1 chunk / flow matching).
- the losses of the auxiliary heads in ``model.aux_heads`` (``align``, ``ground_box``,
  ``ground_visible``, ``ground_free_run``, ``locate``). Each head declares its losses and the
  dataset labels they read (:mod:`robopolicy.models.aux_heads`); the trainer loads the labels of
  the losses whose weight is not 0, and names the weight when the dataset lacks one.

Loop: AdamW (no decay on norms, biases and embeddings), linear warm-up then cosine decay, gradient
clipping, optional EMA of the weights (the saved policies then hold the EMA weights), bf16
autocast (GPU or CPU) or fp16 (GPU), seeded. With frozen encoders the frames are encoded once into a feature
cache (``robopolicy.models.feature_cache``) and every step reads features, not pixels.

Output directory::

    <out>/train_config.yaml           the resolved config
    <out>/checkpoints/step_000500/    policy (model.safetensors + config.yaml) + trainer_state.pt
    <out>/final/                      the final policy
    <out>/metrics.csv                 step, lr, losses, samples/s (TensorBoard in <out>/tb too,
                                      when tensorboard is installed)
    <out>/losses.png                  loss curves
    <out>/train_summary.json          samples/s, first/last losses, timings

``resume=true`` (``--resume``) continues from the newest checkpoint in ``<out>/checkpoints``.

Under torchrun (``robopolicy train --nproc N``) the run is data-parallel (``robopolicy.scale.ddp``):
each rank steps on its share of the same global ``batch_size``; rank 0 alone builds the caches
first and writes the outputs above.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import random
import re
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch

from robopolicy.config import ConfigError, to_dict
from robopolicy.data.loader import FeatureMap, TrainingDataset
from robopolicy.models.feature_cache import ensure_features
from robopolicy.models.modular import ModularPolicy
from robopolicy.models.aux_heads import AuxHeadError, head_sizes, required_labels
from robopolicy.models.policy import ENV_STATE, Policy, PolicyConfig, PolicyError, check_io, check_loss_heads
from robopolicy.scale.ddp import Dist, wrap
from robopolicy.teleop.ratings import rated_episodes, row_ratings, with_ratings
from robopolicy.utils.files import atomic_write_text
from robopolicy.utils.records import write_summary

STATE_FILE = "trainer_state.pt"


@dataclass
class DataConfig:
    """Which dataset and which of its features play which role (any LeRobot v3.0 dataset)."""

    dataset: str = ""
    """LeRobot v3.0 dataset directory."""
    features: FeatureMap = field(default_factory=FeatureMap)
    """Dataset keys → roles (cameras, state, action target, labels); see robopolicy.data.loader."""
    episodes: list[int] | None = None
    """Episode indices to train on (None: all)."""
    rating: str | None = None
    """Only the episodes an operator rated: good, bad, rated (either) or unrated (None: all; see robopolicy.teleop.ratings)."""
    cache_dir: str | None = None
    """Training cache of decoded frames (None: $ROBOPOLICY_CACHE_DIR or ~/.cache/robopolicy/training)."""
    feature_cache: bool = True
    """With frozen encoders, encode each frame once and train on cached features."""
    feature_cache_dir: str | None = None
    """None: ~/.cache/robopolicy/features."""
    num_workers: int = 0
    """DataLoader workers when training on frames (trainable encoders or feature_cache=false)."""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    weight_decay: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    """Cosine decay ends at lr * min_lr_ratio."""
    grad_clip: float = 1.0
    """Max gradient norm (0: no clipping)."""
    encoder_lr_mult: float = 0.1
    """Learning-rate factor of trainable encoders."""


@dataclass
class EmaConfig:
    enabled: bool = False
    decay: float = 0.999


@dataclass
class AugmentConfig:
    """Augmentation of camera frames; only trainable encoders see it (frozen ones read cached features)."""

    shift: int = 0
    """Random shift of up to this many pixels per sample (pad by replication, crop back); 0: off."""


@dataclass
class LossWeights:
    """Weight of each loss; 0 switches it off (and its labels are not loaded). Every loss but
    ``action`` belongs to an auxiliary head, which must be in ``model.aux_heads``."""

    action: float = 1.0
    align: float = 0.0
    """Stage 1 alignment (head ``align``)."""
    ground_box: float = 0.0
    """Stage 2 grounding: where the instructed person is (head ``ground``)."""
    ground_visible: float = 0.0
    """Stage 2 grounding: whether the instructed person is in view (head ``ground``)."""
    ground_free_run: float = 0.0
    """Spatial grounding: how far ahead the robot can drive (head ``free_run``)."""
    locate: float = 0.0
    """Where the named objects are: regress ``model.locate_label`` (head ``locate``)."""


@dataclass
class TrainConfig:
    """One training run (``robopolicy train --config FILE``)."""

    name: str = "train"
    out: str = "outputs/train/run"
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: PolicyConfig = field(default_factory=PolicyConfig)
    loss: LossWeights = field(default_factory=LossWeights)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    init_from: str | None = None
    """A checkpoint (e.g. the previous stage's ``final``) to start from; matching tensors load."""
    locator: str | None = None
    """A checkpoint with a ``locate`` head that estimates this run's scene state
    (``data.features.env_state``) from camera frames. The final checkpoint is then a
    :class:`~robopolicy.models.modular.ModularPolicy`: the locator feeds the trained actor, so
    it runs from cameras alone (intermediate checkpoints stay the actor alone)."""
    steps: int = 1000
    batch_size: int = 64
    optim: OptimConfig = field(default_factory=OptimConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    amp: Literal["none", "bf16", "fp16"] = "none"
    """Mixed-precision autocast. ``bf16`` on a GPU or a CPU (oneDNN runs bf16 convolutions and
    matmuls natively on CPUs with AVX512-BF16 or AMX, about 1.8x a float32 NCHW step for the arm camera
    recipe on 2 cores; on older CPUs it is emulated and slower: measure first); ``fp16`` on a GPU
    only (ignored with a note on a CPU). Weights, optimizer state and checkpoints stay float32."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda, cuda:1, ..."""
    threads: int = 0
    """torch CPU threads (0: torch's default)."""
    save_every: int = 500
    """Checkpoint every N steps (0: only the final one)."""
    log_every: int = 20
    progress: bool = True
    resume: bool = False
    overwrite: bool = False
    """Allow a fresh run into an ``out`` that already holds checkpoints."""

    def __post_init__(self):
        from robopolicy.models.pretrained import check_frozen_sources

        check_frozen_sources(self.model.encoders, self.init_from)


class TrainError(ValueError):
    """A run cannot start or continue; the message says why."""


@dataclass
class TrainResult:
    out: Path
    final: Path
    steps: int
    samples_per_s: float
    seconds: float
    feature_seconds: float
    first_losses: dict[str, float]
    last_losses: dict[str, float]
    used_feature_cache: bool


# --------------------------------------------------------------------------- setup


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def shifted(batches, pad: int, seed: int):
    """``batches`` with every frame batch randomly shifted (``robopolicy.train.augment``)."""
    from robopolicy.train.augment import random_shift

    g = torch.Generator().manual_seed(seed + 1)
    for batch in batches:
        yield random_shift(batch, pad, g)


def _renamed(batches, old: str, new: str):
    """``batches`` with the entry ``old`` under the key ``new``."""
    for batch in batches:
        batch[new] = batch.pop(old)
        yield batch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX tiles); without it oneDNN
    emulates bf16, and a bf16 autocast step measured about half the speed of float32."""
    cpu = getattr(torch._C, "_cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainError(f"device {name!r} requested but CUDA is not available")
    return dev


def loss_weights(cfg: TrainConfig) -> dict[str, float]:
    """The nonzero loss weights, each checked against the heads that compute it."""
    weights = {k: v for k, v in dataclasses.asdict(cfg.loss).items() if v}
    if not weights:
        raise ConfigError("every loss weight is 0: nothing to train (loss.action, loss.align, ...)")
    check_loss_heads(cfg.model, weights)
    return weights


def dataset_labels(cfg: TrainConfig) -> dict[str, str]:
    """Dataset keys loaded at time t beside the action → the setting that asks for each one:
    ``data.features.labels``, a ``loss.<name>`` whose head reads it, ``data.features.env_state``."""
    f = cfg.data.features
    labels = {key: "data.features.labels" for key in f.labels}
    try:
        asked = required_labels(cfg.model, dataclasses.asdict(cfg.loss))
    except AuxHeadError as exc:
        raise PolicyError(str(exc)) from None
    for key, setting in asked.items():
        labels.setdefault(key, setting)
    if f.env_state:
        labels.setdefault(f.env_state, "data.features.env_state")
    return labels


def _episodes(data: DataConfig) -> list[int] | None:
    """``data.episodes``, narrowed to the episodes of ``data.rating`` when one is asked for."""
    if data.rating is None:
        return data.episodes
    try:
        return rated_episodes(data.dataset, data.rating, data.episodes)
    except ValueError as exc:
        raise ConfigError(f"data.rating: {exc}") from None


def _row_ratings(cfg: TrainConfig, ds: TrainingDataset) -> np.ndarray | None:
    """With ``model.condition_on_rating``, each cache row's rating index (robopolicy.teleop.ratings);
    ``None`` when the policy is not conditioned on the rating."""
    if not cfg.model.condition_on_rating:
        return None
    try:
        return row_ratings(cfg.data.dataset, ds.cache.lowdim["episode_index"], ds.episodes)
    except ValueError as exc:
        raise ConfigError(f"model.condition_on_rating: {exc}") from None


def build_dataset(cfg: TrainConfig, progress: bool = True) -> TrainingDataset:
    """The training dataset the model config asks for (context strides, horizon, labels)."""
    if not cfg.data.dataset:
        raise ConfigError("data.dataset (the LeRobot dataset directory) is empty")
    f = cfg.data.features
    labels = dataset_labels(cfg)
    cameras = f.cameras if f.cameras is not None else (list(cfg.model.cameras) or None)
    horizon = 1 if cfg.model.head == "waypoints" else cfg.model.horizon
    return TrainingDataset(cfg.data.dataset, cameras=cameras, state_key=f.state if cfg.model.use_state else None,
                           action_key=f.action, labels=labels, context_strides=cfg.model.context_strides,
                           horizon=horizon, episodes=_episodes(cfg.data), cache_dir=cfg.data.cache_dir,
                           progress=progress)


def model_config_for(cfg: PolicyConfig, ds: TrainingDataset, env_state: str | None = None) -> PolicyConfig:
    """``cfg`` with the dataset-derived fields filled in (cameras, action shape, state sizes, frame
    size, the auxiliary heads' label sizes); ``env_state``: the dataset key of the scene state
    (``data.features.env_state``)."""
    roles = list(ds.cameras)
    if cfg.cameras and list(cfg.cameras) != roles:
        raise PolicyError(f"model.cameras {cfg.cameras} but the dataset gives cameras {roles} "
                          f"(set data.features.cameras to map them)")
    if not roles and not (cfg.use_state or env_state):
        raise PolicyError(f"dataset {ds.root} has no camera the policy could use (and the policy reads no "
                          f"state: set data.features.env_state or model.use_state)")
    stats = ds.stats
    # build_dataset loads env_state beside the labels, so a missing feature has been named there already
    env_state_dim = int(np.asarray(stats[env_state]["mean"]).size) if env_state else 0
    if "action" not in stats:
        raise PolicyError(f"dataset {ds.root} has no statistics for {ds.action_key!r}")
    action_shape = list(np.asarray(stats["action"]["mean"]).shape)
    state_dim = 0
    if cfg.use_state:
        if ds.state_key is None or "observation.state" not in stats:
            raise PolicyError("model.use_state is true but data.features.state names no state feature")
        state_dim = int(np.asarray(stats["observation.state"]["mean"]).size)
    frame = []
    if roles:
        _, h, w = ds.cache.image_shape(ds.cameras[roles[0]])
        frame = [h, w]
    filled = dataclasses.replace(cfg, cameras=roles, action_shape=action_shape, state_dim=state_dim,
                                 env_state_dim=env_state_dim, frame_size=frame)
    filled = dataclasses.replace(filled, **head_sizes(filled, stats))  # e.g. the locate label's size
    check_io(filled)  # before anything is computed from the config (e.g. relative action statistics)
    return filled


def policy_stats(cfg: PolicyConfig, ds: TrainingDataset, env_state: str | None = None) -> dict[str, dict[str, np.ndarray]]:
    """The statistics a new policy carries: the dataset's, with relative action dims' replaced by
    those of the offsets from the state (``model.relative_action``), and the scene state's
    (``env_state``, a dataset key) under ``observation.environment_state``."""
    stats = dict(ds.stats)
    if env_state:
        stats[ENV_STATE] = stats[env_state]
    if cfg.relative_action:
        stats["action"] = ds.relative_action_stats(cfg.relative_action)
    return stats


def param_groups(policy: Policy, cfg: OptimConfig) -> list[dict]:
    """AdamW groups: decayed matrices, undecayed norms/biases/embeddings, slower trainable encoders."""
    groups = {"decay": [], "no_decay": [], "encoder": []}
    for name, p in policy.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("vision."):
            groups["encoder"].append(p)
        elif p.ndim <= 1 or name.startswith(("context.", "backbone.type_embed", "lang_pos")) or name.endswith("queries"):
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    out = [{"params": groups["decay"], "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
           {"params": groups["no_decay"], "weight_decay": 0.0, "lr_mult": 1.0},
           {"params": groups["encoder"], "weight_decay": cfg.weight_decay, "lr_mult": cfg.encoder_lr_mult}]
    return [g for g in out if g["params"]]


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine down to ``min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class Ema:
    """Exponential moving average of a model's floating-point state (weights and buffers)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items() if v.dtype.is_floating_point}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for k, v in model.state_dict().items():
            if k in self.state:
                self.state[k].lerp_(v.detach(), 1 - self.decay)

    def swap_into(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Load the EMA weights into ``model``; returns the raw weights to restore afterwards."""
        raw = {k: v.detach().clone() for k, v in model.state_dict().items() if k in self.state}
        model.load_state_dict(self.state, strict=False)
        return raw


class MetricsLog:
    """CSV of every logged step, plus TensorBoard scalars when tensorboard is installed."""

    def __init__(self, out: Path, resume: bool, log=print):
        self.path = out / "metrics.csv"
        self.rows: list[dict] = []
        if resume and self.path.is_file():
            with open(self.path) as f:
                self.rows = [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"))
        except ImportError:
            log("[train] tensorboard is not installed: metrics go to metrics.csv only")

    def add(self, step: int, values: dict[str, float]) -> None:
        row = {"step": float(step), **values}
        self.rows = [r for r in self.rows if r["step"] < step] + [row]
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, step)
        keys = list(dict.fromkeys(k for r in self.rows for k in r))
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=keys)
            writer.writeheader()
            writer.writerows(self.rows)

    def plot(self, path: Path, title: str) -> Path | None:
        """PNG of every ``loss/*`` curve against the step."""
        keys = [k for k in dict.fromkeys(k for r in self.rows for k in r) if k.startswith("loss/")]
        if not keys:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
        for ax, key in zip(axes[0], keys):
            pts = [(r["step"], r[key]) for r in self.rows if key in r]
            ax.plot([p[0] for p in pts], [p[1] for p in pts])
            ax.set_title(key)
            ax.set_xlabel("step")
            if all(p[1] > 0 for p in pts):
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _latest_checkpoint(out: Path) -> Path | None:
    found = []
    for p in (out / "checkpoints").glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def _load_locator(path: str, actor: Policy, env_key: str | None) -> Policy:
    """The ``locator`` checkpoint, checked against the actor before any training: it must
    estimate the label this run reads as its scene state."""
    try:
        locator = Policy.load(path)
        ModularPolicy(locator, actor)
    except PolicyError as exc:
        raise TrainError(f"locator={path}: {exc}") from None
    if env_key != locator.config.locate_label:
        raise TrainError(f"locator={path} estimates {locator.config.locate_label!r}, but this run's scene "
                         f"state is {env_key!r} (set data.features.env_state: {locator.config.locate_label})")
    return locator


# --------------------------------------------------------------------------- the loop


def train(cfg: TrainConfig, log: Callable[[str], None] = print) -> TrainResult:
    """Run one training recipe; see the module docstring."""
    threads = torch.get_num_threads()
    dist = Dist.from_env()
    try:
        if cfg.threads > 0 and not dist.enabled:  # under torchrun, OMP_NUM_THREADS shares the cores
            torch.set_num_threads(cfg.threads)
        return _train(cfg, log if dist.is_main else (lambda message: None), dist)
    finally:
        dist.close()
        torch.set_num_threads(threads)


def _train(cfg: TrainConfig, log: Callable[[str], None], dist: Dist) -> TrainResult:
    """Set up a run (dataset, policy, optimizer, resume point), take its steps, save it."""
    out = Path(cfg.out)
    latest = _check_out_dir(cfg, out)
    if dist.check_batch(cfg.batch_size):
        raise TrainError(dist.check_batch(cfg.batch_size))
    seed_everything(cfg.seed)
    device = dist.device(resolve_device(cfg.device))
    dist.init(device)
    amp_dtype = _amp_dtype(cfg.amp, device, log)
    weights = loss_weights(cfg)
    with dist.rank_zero_first():  # rank 0 builds the training cache, the others read it
        ds = build_dataset(cfg, progress=cfg.progress and dist.is_main)
    ratings = _row_ratings(cfg, ds)
    env_key = cfg.data.features.env_state
    model_cfg = model_config_for(cfg.model, ds, env_key)
    policy = Policy(model_cfg, policy_stats(model_cfg, ds, env_key)).to(device)
    if dist.enabled:
        torch.manual_seed(dist.seed(cfg.seed))
    locator = _load_locator(cfg.locator, policy, env_key) if cfg.locator else None
    if cfg.init_from and latest is None:
        _init_from(policy, cfg.init_from, log)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        _write_resolved_config(out, dataclasses.replace(cfg, model=model_cfg))
    n_params = sum(p.numel() for p in policy.parameters())
    n_train = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    log(f"[train] {cfg.name}: {ds}")
    log(f"[train] policy: head={model_cfg.head} aux={model_cfg.aux_heads} params={n_params / 1e6:.2f}M "
        f"(trainable {n_train / 1e6:.2f}M) device={device} losses={weights}")
    if dist.enabled:
        log(f"[train] data-parallel: {dist.world} processes, {cfg.batch_size // dist.world} samples each per step")

    with dist.rank_zero_first():  # the frozen-feature cache is encoded once, by rank 0
        use_cache, feats, feature_seconds = _features(cfg, ds, policy, device, log, dist.is_main)
    run = _Run(cfg, out, policy, device, amp_dtype, locator, dist)
    start_step = run.resume(latest, log)
    batches = _batches(cfg, ds, feats, use_cache, policy.vision is None, cfg.seed + start_step, log, dist.shard)
    if env_key and env_key != ENV_STATE:
        batches = _renamed(batches, env_key, ENV_STATE)
    if ratings is not None:
        batches = with_ratings(batches, ratings)
    metrics = MetricsLog(out, resume=latest is not None, log=log) if dist.is_main else None
    t0, started_at = time.perf_counter(), time.time()
    first = run.steps(batches, weights, start_step, metrics)
    seconds = time.perf_counter() - t0
    result, summary = _finish(run, metrics, first, start_step, seconds, feature_seconds, use_cache, log)
    if dist.is_main:
        write_summary(out, kind="train", config=cfg, seeds=[cfg.seed], wall_time_s=seconds,
                      started_at=started_at, metrics={**summary, "steps_run": cfg.steps - start_step,
                                                      "processes": dist.world})
    dist.barrier()  # the others return once the run's outputs are complete
    return result


def _check_out_dir(cfg: TrainConfig, out: Path) -> Path | None:
    """The checkpoint to resume from (``None``: a fresh run); refuses to write over another run."""
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise ConfigError("steps and batch_size must be >= 1")
    latest = _latest_checkpoint(out) if cfg.resume else None
    if not cfg.resume and not cfg.overwrite and ((out / "final").exists() or _latest_checkpoint(out)):
        raise TrainError(f"{out} already holds a run: pass --resume to continue it, overwrite=true to "
                         f"start over, or choose another out=")
    return latest


def _amp_dtype(amp: str, device: torch.device, log: Callable[[str], None]) -> torch.dtype | None:
    """The autocast dtype ``amp`` asks for on ``device`` (``None``: float32)."""
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
    if amp_dtype == torch.float16 and device.type != "cuda":
        log(f"[train] amp=fp16 is GPU-only: training in float32 on {device} (amp=bf16 runs on a CPU)")
        amp_dtype = None
    if amp_dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16():
        log("[train] amp=bf16: this CPU has no AVX512-BF16 or AMX, so bf16 is emulated and usually slower "
            "than float32 (amp=none)")
    return amp_dtype


def _init_from(policy: Policy, checkpoint: str, log: Callable[[str], None]) -> None:
    """Start from an earlier stage's matching tensors."""
    info = policy.load_pretrained(checkpoint)
    fresh = sorted({".".join(k.split(".")[:2]) for k in info["new"]})
    log(f"[train] init from {checkpoint}: {len(info['loaded'])} tensors loaded, {len(info['new'])} "
        f"initialised fresh" + (f" ({', '.join(fresh[:4])})" if fresh else ""))


def _write_resolved_config(out: Path, resolved: TrainConfig) -> None:
    import yaml

    text = yaml.safe_dump(json.loads(json.dumps(to_dict(resolved))), sort_keys=False)
    atomic_write_text(out / "train_config.yaml", text)


def _features(cfg: TrainConfig, ds: TrainingDataset, policy: Policy, device: torch.device,
              log: Callable[[str], None], progress: bool = True) -> tuple[bool, dict, float]:
    """``(train on cached features?, the cached features per camera, seconds spent encoding)``."""
    no_camera = policy.vision is None
    use_cache = no_camera or (cfg.data.feature_cache and policy.vision.frozen)
    if cfg.data.feature_cache and not use_cache:
        log("[train] feature cache off: some encoders are trainable")
    t_feat = time.perf_counter()
    feats = {}
    if use_cache and not no_camera:
        feats = ensure_features(ds, policy.vision, cfg.data.feature_cache_dir, progress=cfg.progress and progress,
                                device=device, log=log, embed_text=policy.frame_text,
                                text_model=policy.config.language.model if policy.language is not None else None)
    return use_cache, feats, time.perf_counter() - t_feat


def _batches(cfg: TrainConfig, ds: TrainingDataset, feats: dict, use_cache: bool, no_camera: bool, seed: int,
             log: Callable[[str], None], shard: tuple[int, int] = (0, 1)):
    """The endless batch iterator: cached features, or frames (augmented when asked); ``shard``:
    ``(rank, world)``, this process's share of every global batch."""
    if use_cache:
        from robopolicy.train.data import CachedFeatureBatches

        if cfg.augment.shift > 0 and not no_camera:
            log("[train] augment.shift ignored: frozen encoders train on cached features")
        return iter(CachedFeatureBatches(ds, feats, cfg.batch_size, seed=seed, shard=shard))
    from robopolicy.train.data import frame_batches

    batches = frame_batches(ds, cfg.batch_size, cfg.data.num_workers, seed=seed, shard=shard)
    return shifted(batches, cfg.augment.shift, seed) if cfg.augment.shift > 0 else batches


class _Run:
    """The optimizer side of a run: optimizer, EMA, grad scaler, checkpoints, the step loop."""

    def __init__(self, cfg: TrainConfig, out: Path, policy: Policy, device: torch.device,
                 amp_dtype: torch.dtype | None, locator: Policy | None, dist: Dist = Dist()):
        self.cfg, self.out, self.policy, self.device, self.amp_dtype, self.locator = (
            cfg, out, policy, device, amp_dtype, locator)
        self.dist = dist
        self.losses = wrap(policy, dist, device)  # policy.losses, or its DDP wrapper
        self.opt = torch.optim.AdamW(param_groups(policy, cfg.optim), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas))
        for g in self.opt.param_groups:
            g["initial_lr"] = cfg.optim.lr * g["lr_mult"]
        self.ema = Ema(policy, cfg.ema.decay) if cfg.ema.enabled else None
        self.scaler = torch.amp.GradScaler("cuda") if amp_dtype == torch.float16 else None

    def resume(self, latest: Path | None, log: Callable[[str], None]) -> int:
        """Load the trainer state of ``latest`` (weights, optimizer, EMA, scaler); the step to start at."""
        if latest is None:
            if self.cfg.resume:
                log(f"[train] --resume: no checkpoint in {self.out / 'checkpoints'}, starting at step 0")
            return 0
        try:
            state = torch.load(latest / STATE_FILE, map_location=self.device, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a torn file or a foreign one
            raise TrainError(f"{latest / STATE_FILE}: cannot read the trainer state ({exc})") from None
        self.policy._load_state(state["raw_weights"], latest / STATE_FILE)
        self.opt.load_state_dict(state["optimizer"])
        if self.ema is not None and state.get("ema") is not None:
            self.ema.state = {k: v.to(self.device) for k, v in state["ema"].items()}
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        start_step = int(state["step"])
        seed_everything(self.dist.seed(self.cfg.seed + start_step))
        log(f"[train] resumed from {latest} at step {start_step}")
        return start_step

    def save(self, step: int, directory: Path, trainer_state: bool) -> None:
        """A policy checkpoint (the EMA weights when on); with ``trainer_state``, what resuming needs.
        The final policy of a run with a locator is the modular policy (locator + this actor)."""
        policy, ema, scaler = self.policy, self.ema, self.scaler
        raw = ema.swap_into(policy) if ema is not None else None
        if self.locator is not None and not trainer_state:
            ModularPolicy(self.locator, policy).save(directory)
        else:
            policy.save(directory)
        if raw is not None:
            policy.load_state_dict(raw, strict=False)
        if trainer_state:
            torch.save({"step": step, "optimizer": self.opt.state_dict(),
                        "raw_weights": {k: v.detach().cpu() for k, v in policy.state_dict().items()},
                        "ema": {k: v.cpu() for k, v in ema.state.items()} if ema is not None else None,
                        "scaler": scaler.state_dict() if scaler is not None else None},
                       directory / STATE_FILE)

    def step(self, step: int, batch: dict, weights: dict[str, float]) -> dict[str, torch.Tensor]:
        """One optimizer step on ``batch``; returns the named losses."""
        cfg, policy, opt, scaler = self.cfg, self.policy, self.opt, self.scaler
        factor = lr_factor(step, cfg.steps, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * factor
        autocast = torch.autocast(self.device.type, dtype=self.amp_dtype) if self.amp_dtype else nullcontext()
        with autocast:
            losses = self.losses(batch, weights)
        loss = losses["total"]
        if not torch.isfinite(loss):
            raise TrainError(f"step {step}: loss is {loss.item()} ({ {k: float(v) for k, v in losses.items()} })")
        opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.grad_clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if self.ema is not None:
            self.ema.update(policy)
        return losses

    def steps(self, batches, weights: dict[str, float], start_step: int, metrics: MetricsLog | None) -> dict[str, float]:
        """Steps ``start_step .. cfg.steps``, logging every ``log_every`` and checkpointing every
        ``save_every``; returns the first step's losses (averaged over the ranks, like the logged
        ones; ``metrics`` is ``None`` on the ranks that write nothing)."""
        from tqdm import tqdm

        cfg, dist = self.cfg, self.dist
        self.policy.train()
        running: dict[str, list[float]] = {}
        first: dict[str, float] = {}
        bar = tqdm(total=cfg.steps, initial=start_step, desc=cfg.name, unit="step",
                   disable=not cfg.progress or not dist.is_main,
                   mininterval=0.5, dynamic_ncols=True)
        t_log, samples_since = time.perf_counter(), 0
        for step in range(start_step, cfg.steps):
            batch = _to_device(next(batches), self.device)
            losses = self.step(step, batch, weights)
            samples_since += len(batch["task"]) if "task" in batch else int(batch["action"].shape[0])
            for k, v in losses.items():
                running.setdefault(k, []).append(float(v.detach()))
            if not first:
                first = dist.mean({k: float(v.detach()) for k, v in losses.items()}, self.device)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.steps:
                now = time.perf_counter()
                sps = samples_since * dist.world / max(now - t_log, 1e-9)
                t_log, samples_since = now, 0
                avg = dist.mean({f"loss/{k}": float(np.mean(v)) for k, v in running.items()}, self.device)
                running = {}
                if metrics is not None:
                    metrics.add(done, {**avg, "lr": self.opt.param_groups[0]["lr"], "samples_per_s": sps})
                bar.set_postfix(loss=f"{avg['loss/total']:.4f}", sps=f"{sps:.0f}")
            bar.update(1)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                if dist.is_main:
                    self.save(done, self.out / "checkpoints" / f"step_{done:06d}", trainer_state=True)
                dist.barrier()
        bar.close()
        return first


def _finish(run: _Run, metrics: MetricsLog | None, first: dict[str, float], start_step: int, seconds: float,
            feature_seconds: float, use_cache: bool, log: Callable[[str], None]) -> tuple[TrainResult, dict]:
    """Save the last trainer state and the final policy; plot and summarize the run (the result
    and the summary written to ``train_summary.json``). Only the rank with ``metrics`` writes."""
    cfg, out = run.cfg, run.out
    steps_run = cfg.steps - start_step
    if metrics is not None:
        run.save(cfg.steps, out / "checkpoints" / f"step_{cfg.steps:06d}", trainer_state=True)
        run.save(cfg.steps, out / "final", trainer_state=False)
    if run.locator is not None:
        log(f"[train] {out / 'final'}: a modular policy (locator {cfg.locator} + this actor)")
    plot = metrics.plot(out / "losses.png", f"{cfg.name} ({run.policy.config.head})") if metrics else None
    rows = metrics.rows if metrics is not None else []
    if metrics is not None:
        metrics.close()
    last = {k.removeprefix("loss/"): v for k, v in rows[-1].items() if k.startswith("loss/")} if rows else {}
    result = TrainResult(out=out, final=out / "final", steps=cfg.steps,
                         samples_per_s=steps_run * cfg.batch_size / seconds if steps_run else 0.0,
                         seconds=seconds, feature_seconds=feature_seconds, first_losses=first,
                         last_losses=last, used_feature_cache=use_cache)
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(result).items()}
    summary["loss_plot"] = str(plot) if plot else None
    if metrics is not None:
        atomic_write_text(out / "train_summary.json", json.dumps(summary, indent=1))
    return result, summary
