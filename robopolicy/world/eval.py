"""How well a world model predicts the simulator (``robopolicy world eval``).

    robopolicy world eval --checkpoint outputs/world/point/final --env robopolicy/PointReach-v0

From ``episodes`` start states (seeds ``seed + i``) the simulator runs ``horizon`` steps of the
task's scripted oracle with DART noise (the datasets' distribution), of the model's policy prior with
Gaussian noise, or of uniform random actions; the model rolls the same
actions open loop from the same first state. Per step k = 1…horizon it reports the state error
(RMS over the state's entries, in state units, through the model's read-out) and the latent error
against the encoding of the simulated state; over every simulated step, the AUC of the success
prediction. Writes ``<out>/prediction.png`` (predicted against simulated trajectories of the
first episodes, and the error against k), ``<out>/errors.csv`` and ``<out>/summary.json``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from robopolicy.envs import EnvConfig
from robopolicy.utils.files import atomic_write_text
from robopolicy.utils.records import write_summary
from robopolicy.world.model import WorldModel, WorldModelError

REPORTED_STEPS = (1, 4, 8, 16, 32)


@dataclass
class WorldEvalConfig:
    """Open-loop prediction against the simulator."""

    checkpoint: str = ""
    env: EnvConfig = field(default_factory=lambda: EnvConfig(id="robopolicy/PointReach-v0"))
    episodes: int = 32
    """Start states (seeds seed … seed + episodes − 1)."""
    horizon: int = 32
    """Open-loop steps k = 1 … horizon."""
    actions: Literal["oracle", "policy", "random"] = "oracle"
    """oracle: the task's scripted oracle (executed action, noise included); policy: the model's policy
    prior on the simulated state, plus Gaussian noise; random: uniform in [-1, 1]."""
    noise: float = 0.3
    seed: int = 100000
    plot_episodes: int = 4
    threads: int = 0
    out: str = "outputs/world/eval"


def auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (the probability a positive outranks a negative; ties count half),
    or None when the labels hold one class only."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels, bool)
    pos, neg = scores[labels], scores[~labels]
    if not len(pos) or not len(neg):
        return None
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    allv = np.concatenate([pos, neg])
    for v in np.unique(allv):  # average ranks of ties
        same = allv == v
        ranks[same] = ranks[same].mean()
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def check_env(model: WorldModel, env) -> None:
    """The env's state and action sizes must be the model's."""
    obs_space = env.observation_space
    state = obs_space["observation.state"].shape if "observation.state" in getattr(obs_space, "spaces", {}) else None
    if state is None:
        raise WorldModelError(f"the env has no observation.state (observation keys: {list(getattr(obs_space, 'spaces', {}))})")
    if int(np.prod(state)) != model.obs_dim or int(np.prod(env.action_space.shape)) != model.act_dim:
        raise WorldModelError(f"the model is for state {model.obs_dim} / action {model.act_dim}, the env has state "
                              f"{int(np.prod(state))} / action {int(np.prod(env.action_space.shape))}")


@torch.no_grad()
def simulate(model: WorldModel, env, seed: int, cfg: WorldEvalConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One start state: ``states (K + 1, D)``, ``actions (K, A)``, ``success (K,)``, ``alive (K,)`` (the
    step was simulated: the episode had not ended)."""
    obs, info = env.reset(seed=seed)
    if cfg.actions == "oracle":
        from sim_envs.core import make_oracle

        try:
            oracle = make_oracle(env, noise=cfg.noise, seed=seed)
        except TypeError as exc:
            raise WorldModelError(f"{exc}: use actions=policy or actions=random") from None
        oracle.reset(obs, info)
    s = np.asarray(obs["observation.state"], np.float32).reshape(-1)
    K, A = cfg.horizon, model.act_dim
    states, actions = np.repeat(s[None], K + 1, 0), np.zeros((K, A), np.float32)
    success, alive = np.zeros(K, bool), np.zeros(K, bool)
    for k in range(K):
        if cfg.actions == "oracle":
            a = np.asarray(oracle.act(obs, info).action, np.float32).reshape(A)
        elif cfg.actions == "random":
            a = rng.uniform(-1, 1, A).astype(np.float32)
        else:
            a, _ = model.pi(model.encode(torch.as_tensor(s)[None]), deterministic=True)
            a = np.clip(a[0].numpy() + cfg.noise * rng.standard_normal(A), -1, 1).astype(np.float32)
        obs, _, terminated, truncated, info = env.step(a)
        s = np.asarray(obs["observation.state"], np.float32).reshape(-1)
        states[k + 1:], actions[k], alive[k], success[k] = s, a, True, bool(info.get("is_success", False))
        if terminated or truncated:
            break
    return {"states": states, "actions": actions, "success": success, "alive": alive}


def evaluate(cfg: WorldEvalConfig, log=print) -> dict:
    """Run the evaluation of the module docstring; returns its metrics."""
    started = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not cfg.checkpoint:
        raise WorldModelError("world eval needs --checkpoint DIR (a world-model checkpoint)")
    from robopolicy.eval.envs import make_task_env

    model = WorldModel.load(cfg.checkpoint)
    env = make_task_env(cfg.env, wrap=False)
    try:
        check_env(model, env)
        rng = np.random.default_rng(cfg.seed)
        runs = [simulate(model, env, cfg.seed + i, cfg, rng) for i in range(cfg.episodes)]
    finally:
        env.close()
    sim = {k: np.stack([r[k] for r in runs]) for k in runs[0]}  # (N, K(+1), ...)
    with torch.no_grad():
        states = torch.as_tensor(sim["states"])
        zs = model.rollout(model.encode(states[:, 0]), torch.as_tensor(sim["actions"]))  # (N, K + 1, L)
        if not torch.isfinite(zs).all():
            raise WorldModelError("the model's open-loop rollout produced NaN or inf: the checkpoint has diverged")
        pred_states = model.decode_state(zs).numpy()
        latent_err = (zs[:, 1:] - model.encode(states[:, 1:])).pow(2).mean(-1).sqrt().numpy()  # (N, K)
        p_success = torch.sigmoid(model.success(zs[:, 1:])).numpy()
        # how far apart the encoder puts the simulated states (near 0: the latent collapsed)
        latent_spread = model.encode(torch.cat([states[:, 0], states[:, 1:][torch.as_tensor(sim["alive"])]])).std(0).mean().item()
    alive = sim["alive"]
    state_err = np.sqrt(((pred_states[:, 1:] - sim["states"][:, 1:]) ** 2).mean(-1))  # (N, K)
    count = alive.sum(0)
    per_k = lambda e: np.where(count > 0, (e * alive).sum(0) / np.maximum(count, 1), np.nan)  # noqa: E731
    state_k, latent_k = per_k(state_err), per_k(latent_err)
    success_auc = auc(p_success[alive], sim["success"][alive])
    metrics = {f"state_error_k{k}": float(state_k[k - 1]) for k in REPORTED_STEPS if k <= cfg.horizon}
    metrics.update({f"latent_error_k{k}": float(latent_k[k - 1]) for k in REPORTED_STEPS if k <= cfg.horizon})
    metrics.update({"success_auc": success_auc, "latent_spread": latent_spread, "simulated_steps": int(alive.sum()),
                    "successes": int(sim["success"][alive].sum()), "state_error": state_k.tolist(),
                    "episodes_alive": count.tolist()})
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "errors.csv", "k,episodes,state_error,latent_error\n" + "".join(
        f"{k + 1},{count[k]},{state_k[k]:.6g},{latent_k[k]:.6g}\n" for k in range(cfg.horizon)))
    plot(out / "prediction.png", sim, pred_states, state_k, cfg.plot_episodes)
    write_summary(out, kind="world", config=cfg, seeds=list(range(cfg.seed, cfg.seed + cfg.episodes)),
                  episodes=cfg.episodes, metrics=metrics, started_at=started)
    log(f"state error k=" + ", ".join(f"{k}: {metrics[f'state_error_k{k}']:.4f}" for k in REPORTED_STEPS
                                       if f"state_error_k{k}" in metrics)
        + f"; success AUC {'n/a (one class)' if success_auc is None else f'{success_auc:.3f}'}; plot {out / 'prediction.png'}")
    return metrics


def plot(path: Path, sim: dict[str, np.ndarray], pred: np.ndarray, state_k: np.ndarray, episodes: int) -> Path:
    """Predicted (dashed) against simulated (solid) state entries of the first episodes, and the error against k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    episodes = min(episodes, len(pred))
    dims = min(pred.shape[-1], 6)
    fig, axes = plt.subplots(1, episodes + 1, figsize=(3.2 * (episodes + 1), 3), squeeze=False)
    for i in range(episodes):
        ax, last = axes[0, i], int(sim["alive"][i].sum()) + 1
        for d in range(dims):
            line, = ax.plot(sim["states"][i, :last, d], lw=1.5)
            ax.plot(pred[i, :last, d], "--", color=line.get_color(), lw=1.2)
        ax.set(title=f"episode {i}: sim (—) vs model (--)", xlabel="step k")
    axes[0, -1].plot(np.arange(1, len(state_k) + 1), state_k, marker=".")
    axes[0, -1].set(title="open-loop state error", xlabel="k", ylabel="RMS error")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
