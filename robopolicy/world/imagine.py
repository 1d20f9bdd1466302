"""Refine a policy inside a world model (``robopolicy refine --method world-model``).

    robopolicy refine --method world-model --env robopolicy/PointReach-v0 --config configs/refine/world_model/point.yaml

Dyna-style, read top to bottom: each iteration rolls the policy (the model's ``pi`` with noise)
out in the simulator for a few episodes, adds them to the episodes (those of ``dataset`` first),
updates the world model on them (``train.fit``: latent consistency, reward, success, and the Q
ensemble's TD error on real transitions: the critic), then improves the actor in imagination:
from real start states the model rolls ``pi`` over ``imagine_horizon`` steps and the actor
maximises the λ-return

    G_k = r_k − β·σ_k + γ (1 − p_k) ((1 − λ) V(z_{k+1}) + λ G_{k+1}),   G_H = V(z_H) = min Q(z_H, pi(z_H))

with gradients through the latent dynamics (the model's own weights are not moved by the actor),
where σ_k is the Q ensemble's disagreement on the imagined step (a penalty that keeps
imagination near the data, and is reported) and p_k the predicted chance the episode ended in
success. Every ``eval_every`` iterations the deterministic policy is checked in the simulator.
``world`` starts from a trained model; ``offline: true`` keeps it frozen and rolls nothing out:
the actor learns only in the model, from the dataset's start states (World4RL's setting: the
simulator only evaluates).

Writes ``<out>/final`` (the refined world model: its ``pi`` is the policy), ``<out>/best`` (the
model at the best evaluation: imagination can exploit the model's errors later on), ``curve.csv``
(success against simulator steps) and ``summary.json``. The policy here is the whole policy (no
base). A loss or an imagined return that turns non-finite stops the loop, logged and recorded in
``stopped``; the summary is still written, and ``final`` only when its weights are finite.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from robopolicy.envs import EnvConfig
from robopolicy.utils.files import atomic_write_text
from robopolicy.utils.records import write_summary
from robopolicy.world.data import Episodes, read_episodes
from robopolicy.world.model import WorldModel, WorldModelConfig, WorldModelError
from robopolicy.world.train import WorldTrainConfig, fit, optimizers


@dataclass
class WorldRefineConfig:
    """Actor-critic in imagination with Dyna-style model updates."""

    env: EnvConfig = field(default_factory=lambda: EnvConfig(id="robopolicy/PointReach-v0"))
    base: str | None = None
    """A frozen base policy to put the residual over (not yet supported: the policy is the model's pi)."""
    world: str = ""
    """World-model checkpoint to start from; empty: a new model of ``model``'s config."""
    dataset: str = ""
    """LeRobot dataset whose episodes start the replay (optional)."""
    model: WorldModelConfig = field(default_factory=WorldModelConfig)
    offline: bool = False
    """Refine inside the frozen ``world`` model from ``dataset``'s states only: no rollouts, no model updates."""
    seed_episodes: int = 20
    """Episodes of uniform random actions before the first update (TD-MPC2's seed steps): data that
    covers the action space, so the reward and dynamics are learnt beyond the untrained policy's
    narrow actions. Not in offline mode."""
    pretrain_steps: int = 500
    """World-model updates on the seed episodes (and ``dataset``) before the first iteration."""
    iterations: int = 10
    """Dyna iterations: real rollouts, model updates, actor updates in imagination."""
    episodes_per_iteration: int = 8
    explore_noise: float = 0.3
    """Gaussian noise on the policy's action in the real rollouts."""
    model_steps: int = 100
    """World-model updates per iteration."""
    imagine_steps: int = 50
    """Actor updates in imagination per iteration."""
    imagine_horizon: int = 8
    imagine_batch: int = 256
    lam: float = 0.95
    disagreement_coef: float = 1.0
    entropy_coef: float = 1e-4
    horizon: int = 5
    """Window of the model's training losses."""
    batch_size: int = 128
    lr: float = 3e-4
    eval_every: int = 2
    eval_episodes: int = 20
    seed: int = 0
    threads: int = 0
    device: str = "cpu"
    out: str = "outputs/refine/world_model"
    progress: bool = True


def imagine(model: WorldModel, z: torch.Tensor, horizon: int, cfg: WorldRefineConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """λ-returns ``G_0 (B,)`` of ``pi`` rolled ``horizon`` steps from latents ``z (B, L)``, and the rollout's statistics."""
    rewards, conts, values, disagreements, logps = [], [], [], [], []
    for _ in range(horizon):
        a, logp = model.pi(z)
        q_all = model.Q(z, a, "all")  # (num_q, B)
        rewards.append(model.reward(z, a))
        disagreements.append(q_all.std(0))
        logps.append(logp)
        z = model.next(z, a)
        conts.append(1 - torch.sigmoid(model.success(z)))
        a_next, _ = model.pi(z)
        values.append(model.Q(z, a_next, "min"))
    G = values[-1]
    for k in reversed(range(horizon)):
        G = rewards[k] - cfg.disagreement_coef * disagreements[k] + model.cfg.gamma * conts[k] * (
            (1 - cfg.lam) * values[k] + cfg.lam * G) - cfg.entropy_coef * logps[k]
    if not torch.isfinite(G).all():
        raise WorldModelError("imagination produced NaN or inf returns: the world model has diverged; "
                              "lower lr or shorten imagine_horizon")
    stats = {"imagined_return": G.mean().item(), "disagreement": torch.stack(disagreements).mean().item(),
             "imagined_success": (1 - torch.stack(conts)).max(0).values.mean().item()}
    return G, stats


def actor_step(model: WorldModel, episodes: Episodes, pi_optim: torch.optim.Optimizer, cfg: WorldRefineConfig,
               rng: np.random.Generator) -> dict[str, float]:
    """One actor update in imagination from real start states."""
    with torch.no_grad():
        z0 = model.encode(torch.as_tensor(episodes.start_states(cfg.imagine_batch, rng), device=cfg.device))
    G, stats = imagine(model, z0, cfg.imagine_horizon, cfg)
    pi_optim.zero_grad(set_to_none=True)
    (-G.mean()).backward()
    pi_optim.step()
    model.zero_grad(set_to_none=True)  # the model's weights got gradients through the rollout: drop them
    return stats


@torch.no_grad()
def policy_action(model: WorldModel, states: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    """``pi`` on observed states ``(N, D)`` → actions ``(N, A)`` in [-1, 1], with Gaussian ``noise``."""
    a, _ = model.pi(model.encode(torch.as_tensor(np.asarray(states, np.float32))), deterministic=True)
    a = a.numpy()
    return np.clip(a + noise * rng.standard_normal(a.shape), -1, 1).astype(np.float32) if noise else a


def rollout(model: WorldModel, env, seed: int, cfg: WorldRefineConfig, rng: np.random.Generator,
            random: bool = False) -> tuple[list, int]:
    """One real episode of the noisy policy (uniform random actions with ``random``) → ``([obs (T + 1, D),
    actions (T, A), rewards (T,), successes (T,)], T)``."""
    obs, _ = env.reset(seed=seed)
    states, actions, rewards, successes = [np.asarray(obs["observation.state"], np.float32).reshape(-1)], [], [], []
    while True:
        if random:
            a = rng.uniform(-1, 1, model.act_dim).astype(np.float32)
        else:
            a = policy_action(model, states[-1][None], cfg.explore_noise, rng)[0]
        obs, r, terminated, truncated, info = env.step(a)
        states.append(np.asarray(obs["observation.state"], np.float32).reshape(-1))
        actions.append(a), rewards.append(float(r)), successes.append(bool(info.get("is_success", False)))
        if terminated or truncated:
            # a truncated episode's last state is known but its value is not: keep it as if unknown
            return [np.stack(states if terminated else states[:-1]), np.stack(actions), np.array(rewards),
                    np.array(successes, np.float32)], len(actions)


def normalise(model: WorldModel, episodes: Episodes, cfg: WorldRefineConfig) -> None:
    """A new model (no ``world``) takes its normalisation from the data it starts from."""
    if not cfg.world:
        model.fit_normalisation(np.concatenate(episodes.obs), np.concatenate([s[1] for s in episodes.steps]))


def success_in_sim(model: WorldModel, cfg: WorldRefineConfig, seed: int) -> float:
    """Success rate of the deterministic policy over ``eval_episodes`` simulator episodes."""
    from robopolicy.eval.episodes import evaluate_success

    act = lambda obs: policy_action(model, obs["observation.state"], 0.0, None)  # noqa: E731
    return evaluate_success(act, lambda rows: None, cfg.env, cfg.eval_episodes, 1, seed).success


def train(cfg: WorldRefineConfig, log=print) -> dict:
    """Run the refinement of the module docstring; returns its summary."""
    started = time.time()
    if cfg.base:
        raise WorldModelError("world-model refinement of a residual over a base policy is not supported yet: "
                              "drop --checkpoint (the model's policy prior is refined as the whole policy)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    from robopolicy.eval.envs import make_task_env
    from robopolicy.world.eval import check_env

    env = make_task_env(cfg.env, wrap=False)
    obs_dim = int(np.prod(env.observation_space["observation.state"].shape))
    act_dim = int(np.prod(env.action_space.shape))
    episodes = read_episodes(cfg.dataset) if cfg.dataset else Episodes(obs_dim, act_dim)
    if cfg.world:
        model = WorldModel.load(cfg.world, cfg.device)
    else:
        model = WorldModel(obs_dim, act_dim, cfg.model).to(cfg.device)
    check_env(model, env)
    if cfg.offline and not (cfg.world and cfg.dataset):
        raise WorldModelError("offline refinement needs world=CHECKPOINT (the frozen model) and dataset=DIR (its start states)")
    if (episodes.obs_dim, episodes.act_dim) != (obs_dim, act_dim):
        raise WorldModelError(f"{cfg.dataset}: state {episodes.obs_dim} / action {episodes.act_dim}, the env has "
                              f"state {obs_dim} / action {act_dim}")
    train_cfg = WorldTrainConfig(horizon=cfg.horizon, batch_size=cfg.batch_size, lr=cfg.lr, device=cfg.device,
                                 entropy_coef=cfg.entropy_coef)
    optim, pi_optim = optimizers(model, cfg.lr)
    sim_steps, rows, stats = 0, ["iteration,env_steps,success,imagined_return,disagreement"], {}
    dataset_steps = episodes.num_steps
    before = success_in_sim(model, cfg, cfg.seed + 10**6)
    curve, out = [(0, before)], Path(cfg.out)
    best, stopped = (0, before, None), None  # best: env steps, success, checkpoint of the best evaluation so far
    try:  # a diverged model or imagination stops the loop (logged, recorded); what was learnt before is kept
        for _ in range(0 if cfg.offline else cfg.seed_episodes):
            episode, steps = rollout(model, env, cfg.seed + sim_steps, cfg, rng, random=True)
            episodes.add(*episode)
            sim_steps += steps
        if not cfg.offline and len(episodes):
            normalise(model, episodes, cfg)
            fit(model, episodes, cfg.pretrain_steps, train_cfg, rng, optim, pi_optim)
        for it in range(1, cfg.iterations + 1):
            for _ in range(0 if cfg.offline else cfg.episodes_per_iteration):
                episode, steps = rollout(model, env, cfg.seed + sim_steps, cfg, rng)
                episodes.add(*episode)
                sim_steps += steps
            if not cfg.offline:
                if it == 1 and not (cfg.seed_episodes or cfg.dataset):
                    normalise(model, episodes, cfg)
                fit(model, episodes, cfg.model_steps, train_cfg, rng, optim, pi_optim)
            for _ in range(cfg.imagine_steps):
                stats = actor_step(model, episodes, pi_optim, cfg, rng)
            if it % cfg.eval_every == 0 or it == cfg.iterations:
                success = success_in_sim(model, cfg, cfg.seed + 10**6)
                curve.append((sim_steps, success))
                if success > best[1]:  # imagination can overfit the model later: keep the best policy seen
                    best = (sim_steps, success, str(model.save(out / "best")))
                rows.append(f"{it},{sim_steps},{success:.4f},{stats['imagined_return']:.4g},{stats['disagreement']:.4g}")
                if cfg.progress:
                    log(f"iteration {it}: {sim_steps} env steps, success {100 * success:.1f}%, imagined return "
                        f"{stats['imagined_return']:.3f}, disagreement {stats['disagreement']:.4f}")
    except WorldModelError as exc:
        stopped = str(exc)
        log(f"stopped after {sim_steps} env steps: {exc}")
    finally:
        env.close()
    finite = all(torch.isfinite(p).all() for p in model.state_dict().values())
    checkpoint = model.save(out / "final") if finite else best[2]  # never a NaN checkpoint
    atomic_write_text(out / "curve.csv", "\n".join(rows) + "\n")
    after = curve[-1][1]
    reached = next((steps for steps, s in curve if s >= 0.8), None)
    metrics = {"before": before, "after": after, "env_steps": sim_steps, "steps_to_80": reached,
               "disagreement": stats.get("disagreement"), "imagined_return": stats.get("imagined_return"),
               "dataset_steps": dataset_steps, "checkpoint": None if checkpoint is None else str(checkpoint), "best": best[1],
               "best_env_steps": best[0], "best_checkpoint": best[2], "curve": curve, "stopped": stopped}
    write_summary(out, kind="refine", config=cfg, seeds=[cfg.seed], episodes=cfg.eval_episodes, metrics=metrics,
                  started_at=started)
    return {**metrics, "seconds": time.time() - started}
