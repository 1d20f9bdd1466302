"""Train a world model from a LeRobot dataset (``robopolicy world train``).

    robopolicy world train --config configs/world/point.yaml dataset=outputs/datasets/point

Reads top to bottom: load the episodes, hold some out, fit the normalisation, then for each step
sample windows of ``horizon`` steps, roll the latent dynamics over them open loop and minimise

    consistency_coef · Σ_k ρ^k ‖next(z_k, a_k) − sg(encode(o_{k+1}))‖²
  + reward_coef · Σ_k ρ^k CE(reward(z_k, a_k), r_k)
  + success_coef · Σ_k ρ^k BCE(success(z_{k+1}), s_k)
  + value_coef · Σ_k ρ^k Σ_i CE(Q_i(z_k, a_k), r_k + γ (1 − s_k) Q̄(z'_{k+1}, π(z'_{k+1})))

where z'_{k+1} = encode(o_{k+1}) without gradient, Q̄ the lower of two target heads drawn at
random, and CE the cross-entropy of the predicted bins against the two-hot target (TD-MPC2's
objective with a success head), then update the policy prior π to maximise Q. The
model's state read-out learns on detached latents. Writes ``<out>/final`` (the checkpoint),
``<out>/curve.csv`` and ``<out>/summary.json``. A non-finite loss stops the run with an error
naming the step, never a silent divergence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from robopolicy.utils.files import atomic_write_text
from robopolicy.utils.records import write_summary
from robopolicy.world.data import Episodes, read_episodes
from robopolicy.world.model import WorldModel, WorldModelConfig, WorldModelError, scalar_loss


@dataclass
class WorldTrainConfig:
    """World model training from a dataset."""

    dataset: str = ""
    """LeRobot dataset directory with observation.state, action, next.reward, next.success (or next.done)."""
    model: WorldModelConfig = field(default_factory=WorldModelConfig)
    horizon: int = 8
    """Steps of the open-loop rollout each window trains (TD-MPC2: 3; longer suits chunks)."""
    steps: int = 3000
    """Gradient steps."""
    batch_size: int = 256
    lr: float = 3e-4
    entropy_coef: float = 1e-4
    """Weight of the policy prior's entropy term."""
    grad_clip: float = 20.0
    held_out: float = 0.1
    """Fraction of the episodes held out for the validation losses."""
    log_every: int = 250
    seed: int = 0
    threads: int = 0
    """torch CPU threads (0: torch's default)."""
    device: str = "cpu"
    out: str = "outputs/world/train"
    progress: bool = True


def as_tensors(batch: dict[str, np.ndarray], device: str | torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(v, device=device) for k, v in batch.items()}


def model_losses(model: WorldModel, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """The world model's loss on a window batch (module docstring) → ``(total, parts, rolled latents (B, H + 1, L))``."""
    cfg, H = model.cfg, b["action"].shape[1]
    weights = cfg.rho ** torch.arange(H, device=b["action"].device, dtype=torch.float32)  # (H,)
    with torch.no_grad():
        z_target = model.encode(b["obs"][:, 1:])  # (B, H, L)
        a_next, _ = model.pi(z_target)
        q_next = model.Q(z_target, a_next, "min", target=True)  # (B, H)
        td = b["reward"] + cfg.gamma * (1 - b["success"]) * b["next_known"] * q_next
        # a step whose next observation is unknown and which did not end in success (a truncation) has no target
        value_mask = b["valid"] * torch.maximum(b["next_known"], b["success"])
    zs = model.rollout(model.encode(b["obs"][:, 0]), b["action"])  # (B, H + 1, L)

    def weighted(per_step: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (per_step * mask * weights).sum() / mask.sum().clamp(min=1)

    consistency = weighted(((zs[:, 1:] - z_target) ** 2).mean(-1), b["next_known"])
    scale = model.reward_scale
    reward = weighted(scalar_loss(model.reward_logits(zs[:, :-1], b["action"]), b["reward"] / scale, cfg), b["valid"])
    success = weighted(F.binary_cross_entropy_with_logits(model.success(zs[:, 1:]), b["success"], reduction="none"),
                       b["valid"])
    q_logits = model.Q(zs[:, :-1], b["action"], "logits")  # (num_q, B, H, num_bins)
    value = weighted(scalar_loss(q_logits, (td / scale).expand(len(q_logits), *td.shape), cfg).sum(0), value_mask)
    norm_obs = (b["obs"] - model.obs_mean) / model.obs_std
    readout = (((model.decode_state(zs.detach()) - model.obs_mean) / model.obs_std - norm_obs) ** 2).mean()
    total = (cfg.consistency_coef * consistency + cfg.reward_coef * reward + cfg.success_coef * success
             + cfg.value_coef * value + readout)
    parts = {"consistency": consistency.item(), "reward": reward.item(), "success": success.item(),
             "value": value.item(), "readout": readout.item()}
    return total, parts, zs


def pi_loss(model: WorldModel, zs: torch.Tensor, entropy_coef: float) -> torch.Tensor:
    """Policy prior: maximise the mean of two Q heads (scaled to ~1) plus entropy, over detached latents."""
    a, logp = model.pi(zs.detach())
    q = model.Q(zs.detach(), a, "avg")
    return (entropy_coef * logp - q / q.abs().mean().detach().clamp(min=1.0)).mean()


def check_finite(loss: torch.Tensor, step: int, parts: dict[str, float]) -> None:
    """Stop a diverged run with an error naming the step and the losses."""
    if not torch.isfinite(loss):
        raise WorldModelError(f"world model training diverged at step {step}: losses {parts}; "
                              "lower lr or check the dataset for NaN")


def fit(model: WorldModel, episodes: Episodes, steps: int, cfg: WorldTrainConfig, rng: np.random.Generator,
        optim: torch.optim.Optimizer, pi_optim: torch.optim.Optimizer, log=None) -> dict[str, float]:
    """``steps`` gradient steps on windows of ``episodes``; returns the last step's loss parts."""
    model.train()
    parts: dict[str, float] = {}
    for step in range(steps):
        b = as_tensors(episodes.sample(cfg.batch_size, cfg.horizon, rng), cfg.device)
        total, parts, zs = model_losses(model, b)
        check_finite(total, step, parts)
        optim.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optim.step()
        loss_pi = pi_loss(model, zs, cfg.entropy_coef)
        pi_optim.zero_grad(set_to_none=True)
        loss_pi.backward()
        pi_optim.step()
        model.soft_update_targets()
        if log is not None:
            log(step, parts)
    return parts


def optimizers(model: WorldModel, lr: float) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Adam for everything but the policy prior (the encoder at ``enc_lr_scale`` × lr), and Adam for the prior alone."""
    own = set(map(id, model._pi.parameters())) | set(map(id, model._encoder.parameters()))
    rest = [p for p in model.parameters() if id(p) not in own and p.requires_grad]
    groups = [{"params": rest}, {"params": list(model._encoder.parameters()), "lr": lr * model.cfg.enc_lr_scale}]
    return torch.optim.Adam(groups, lr=lr), torch.optim.Adam(model._pi.parameters(), lr=lr)


@torch.no_grad()
def validation_losses(model: WorldModel, episodes: Episodes, cfg: WorldTrainConfig, rng: np.random.Generator) -> dict[str, float]:
    """The loss parts on held-out windows (no update)."""
    model.eval()
    _, parts, _ = model_losses(model, as_tensors(episodes.sample(cfg.batch_size, cfg.horizon, rng), cfg.device))
    return parts


def train(cfg: WorldTrainConfig, log=print) -> dict:
    """Train a world model on ``cfg.dataset``; returns the run's summary."""
    started = time.time()
    if not cfg.dataset:
        raise WorldModelError("world train needs dataset=DIR (a LeRobot dataset with state, action, reward, success)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    episodes = read_episodes(cfg.dataset)
    kept, held_out = episodes.split(cfg.held_out, rng)
    states = np.concatenate(kept.obs)
    model = WorldModel(episodes.obs_dim, episodes.act_dim, cfg.model)
    model.fit_normalisation(states, np.concatenate([s[1] for s in kept.steps]))
    model.to(cfg.device)
    optim, pi_optim = optimizers(model, cfg.lr)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = ["step,split,consistency,reward,success,value,readout"]

    def record(step: int, parts: dict[str, float]) -> None:
        if (step + 1) % cfg.log_every and step + 1 != cfg.steps:
            return
        val = validation_losses(model, held_out, cfg, rng) if len(held_out) else {}
        model.train()
        for split, p in (("train", parts), ("held_out", val)):
            if p:
                rows.append(f"{step + 1},{split}," + ",".join(f"{p[k]:.6g}" for k in rows[0].split(",")[2:]))
        if cfg.progress:
            log(f"step {step + 1}/{cfg.steps}: " + ", ".join(f"{k} {v:.4g}" for k, v in (val or parts).items()))

    log(f"world model ({cfg.model.kind}): {len(kept)} episodes, {kept.num_steps} steps "
        f"({len(held_out)} held out); state {episodes.obs_dim}, action {episodes.act_dim}")
    parts = fit(model, kept, cfg.steps, cfg, rng, optim, pi_optim, record)
    val = validation_losses(model, held_out, cfg, rng) if len(held_out) else {}
    checkpoint = model.save(out / "final")
    atomic_write_text(out / "curve.csv", "\n".join(rows) + "\n")
    metrics = {"train": parts, "held_out": val, "episodes": len(kept), "held_out_episodes": len(held_out),
               "dataset_steps": episodes.num_steps, "checkpoint": str(checkpoint)}
    write_summary(out, kind="world", config=cfg, seeds=[cfg.seed], episodes=len(episodes), metrics=metrics,
                  started_at=started)
    return {**metrics, "seconds": time.time() - started}
