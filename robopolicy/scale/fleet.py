"""Fleet post-training on Ray: N robots run the policy, an operator intervenes, one learner
retrains and publishes new weights, the robots pick them up between episodes.

    robopolicy fleet --config configs/scale/fleet_point.yaml

- **Actors** (:class:`EpisodeRunner` in a Ray actor, one sim robot each) run whole episodes: the
  policy's chunks through the chunk executor (the one ``robopolicy eval`` and the refinement loops
  use), a :class:`~hardware.teleop.SimOperator` watching and taking over (HG-DAgger's
  interventions). Every ``eval_every``-th episode runs without the operator: its success is the
  policy's own, the curve plotted against wall clock. The real-time control node is not run per
  actor: on a small machine its fixed-rate loop and policy-worker process per robot would cost
  more than the simulation; the episode runner executes the same chunks step by step instead.
- **Weights** come with each episode request: ``(version, weights)``, the newest published. An
  actor loads them before the episode starts when the version is newer than its own, never during
  one, and every frame records the version that drove it.
- **Learner** (:class:`~robopolicy.scale.fleet_learner.FleetLearner`, in the driver): a bounded
  intake queue, an ingest thread (labels + the LeRobot dataset) and a training thread (HG-DAgger's
  fine-tuning step), publishing ``weights/v<NNNNNN>/`` + ``latest.json``.
- **A robot that dies** (its actor process killed, a node lost) is replaced by a new actor and its
  episode runs again from its seed (:func:`robopolicy.scale.ray_backend.run_pool`); the count is in
  the summary.

``ray.address`` unset starts Ray on this machine; ``auto`` joins a ``ray start`` cluster. The base
checkpoint (and ``train.original``) must be readable where the actors (and the driver) run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from robopolicy.data import features as F
from robopolicy.envs import EnvConfig
from robopolicy.scale.fleet_learner import POLICY_ACTION, FleetLearner, load_arrays
from robopolicy.scale.ray_backend import RayConfig


@dataclass
class FleetConfig:
    """``robopolicy fleet``: robots, operator, learner and where the run writes."""

    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/PointReach-v0"))
    base: str = ""
    """The checkpoint the fleet starts from (version 0)."""
    actors: int = 2
    """Robots (Ray actors), one env each."""
    episodes: int = 200
    """Episodes the fleet runs in all; episode ``i`` starts from seed ``seed + i``."""
    eval_every: int = 4
    """Every ``eval_every``-th episode runs without the operator (the policy's own success); 0: none."""
    retrain_every: int = 100
    """New intervention labels that start a training step (then a new version is published); 0:
    train back to back while there are labels."""
    operator: dict | None = field(default_factory=dict)
    """SimOperator settings (as ``refine --method hg-dagger``); null: no interventions, nothing to learn."""
    label: str = "operator"
    """What an intervention state learns: ``operator`` (the executed action) or ``oracle`` (the clean one)."""
    control_dt: float = 0.1
    steps_per_chunk: int | None = None
    train: dict = field(default_factory=dict)
    """HG-DAgger's training settings: finetune_steps, batch_size, lr, original, original_action,
    original_fraction, max_states, filter, weights, device."""
    queue: int = 64
    """Episodes the learner's intake holds; when it is full the robots wait, the trainer never does."""
    dataset: str = ""
    """The LeRobot dataset the episodes are appended to (empty: ``<out>/dataset``)."""
    resume: bool = False
    """Append to an existing dataset."""
    vcodec: str = "libsvtav1"
    ray: RayConfig = field(default_factory=RayConfig)
    seed: int = 0
    threads: int = 1
    """Torch threads of the learner and of each actor."""
    window: int = 10
    """Evaluation episodes per point of the success curve (a moving mean)."""
    version_episodes: int = 0
    """After the run, each published version's success on the same episodes (seeds ``version_seed``
    on, the policy alone): the success-against-wall-clock curve without the seed-to-seed noise of
    the fleet's own evaluation episodes; 0: none (``robopolicy fleet --versions`` runs it later)."""
    version_seed: int = 100_000
    out: str = "outputs/fleet/run"

    def __post_init__(self):
        if self.version_episodes < 0:
            raise ValueError(f"fleet.version_episodes must be >= 0, got {self.version_episodes}")
        for key in ("actors", "episodes", "queue", "window"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"fleet.{key} must be >= 1, got {getattr(self, key)}")
        if self.retrain_every < 0:
            raise ValueError(f"fleet.retrain_every must be >= 0 (0: train back to back), got {self.retrain_every}")
        if self.eval_every < 0:
            raise ValueError(f"fleet.eval_every must be >= 0 (0: no evaluation episodes), got {self.eval_every}")
        if not self.base:
            raise ValueError("fleet.base: the checkpoint the fleet starts from is required (--checkpoint)")
        if self.label not in ("operator", "oracle"):
            raise ValueError(f"fleet.label: {self.label!r} is not 'operator' or 'oracle'")

    def hg_dagger(self):
        """The training step's settings as ``refine --method hg-dagger`` reads them (errors name ``train.*``)."""
        from robopolicy.config import build
        from robopolicy.teleop.hg_dagger import HGDAggerConfig

        data = {"env": {"id": self.env.id, "kwargs": dict(self.env.kwargs)}, "base": self.base,
                "operator": dict(self.operator or {}), "label": self.label, "control_dt": self.control_dt,
                "seed": self.seed, "threads": self.threads, "out": self.out, "progress": False, **self.train}
        return build(HGDAggerConfig, data, "fleet config", prefix="train.")

    def is_eval(self, episode: int) -> bool:
        return self.eval_every > 0 and episode % self.eval_every == self.eval_every - 1


class EpisodeRunner:
    """One robot: a sim env, the policy through the chunk executor and a SimOperator. Runs whole
    episodes (:meth:`run_episode`); in a Ray actor on the fleet, or in this process."""

    def __init__(self, actor_id: int, env: dict, base: str, operator: dict | None, control_dt: float,
                 steps_per_chunk: int | None, seed: int, threads: int = 1):
        os.environ.setdefault("MUJOCO_GL", "egl")
        import torch

        from robopolicy.eval.envs import make_task_envs
        from robopolicy.models.loading import load_policy
        from robopolicy.refine import dagger

        torch.set_num_threads(max(1, threads))
        self.actor_id, self.version, self.swaps = int(actor_id), 0, 0
        self.policy = load_policy(base) if isinstance(base, str) else base
        self.act, self.reset = dagger.policy_actor(self.policy, steps_per_chunk, False)
        self.envs = make_task_envs(EnvConfig(**env) if isinstance(env, dict) else env, 1, autoreset=False,
                                   reward="dense", oracle=True)
        self.fps = int(self.envs.metadata.get("render_fps") or round(1 / control_dt))
        self.operator = None
        if operator is not None:
            from hardware.teleop.sim_operator import SimOperator

            self.operator = SimOperator(None, control_dt, seed + 7919 * self.actor_id,
                                        action_space=self.envs.single_action_space, **operator)

    def swap(self, version: int, weights: Any) -> bool:
        """Load ``weights`` when ``version`` is newer than the running one (between episodes only)."""
        if version < self.version:
            raise ValueError(f"actor {self.actor_id}: weights v{version} are older than its v{self.version}")
        if version == self.version:
            return False
        load_arrays(self.policy, weights)
        self.policy.eval()
        self.version, self.swaps = int(version), self.swaps + 1
        return True

    def run_episode(self, seed: int, version: int, weights: Any, evaluate: bool = False) -> dict:
        """One episode from ``seed`` with weights ``version`` (loaded first if newer); the episode
        as the learner takes it (:mod:`robopolicy.scale.fleet_learner`)."""
        from robopolicy.eval.envs import SUCCESS_KEYS

        self.swap(version, weights)
        ran = self.version
        obs, info = self.envs.reset(seed=[int(seed)])
        self.reset(None)
        operator = None if evaluate else self.operator
        if operator is not None:
            operator.reset_episode()
        cols: dict[str, list] = {k: [] for k in (F.ACTION, POLICY_ACTION, F.ORACLE_ACTION, F.INTERVENTION, "flags",
                                                 F.REWARD, F.SUCCESS, "wall")}
        seen: dict[str, list] = {k: [] for k in obs if k != "task"}
        task = str(obs["task"][0]) if "task" in obs else ""
        success, t0 = False, time.perf_counter()
        while True:
            own = self.act(obs)[0]
            label = np.asarray(info["oracle_label"][0], np.float32)
            action, intervening = own, False
            if operator is not None:
                st = operator.step({k: v[0] for k, v in obs.items()}, {}, own, label=label)
                action, intervening = np.asarray(st.action, np.float32), st.intervening
            for k in seen:
                seen[k].append(np.array(obs[k][0]))
            cols["wall"].append(time.perf_counter() - t0)
            obs, reward, term, trunc, info = self.envs.step(action[None])
            success = success or any(bool(np.asarray(info.get(k, [False]))[0]) for k in SUCCESS_KEYS)
            for key, value in ((F.ACTION, action), (POLICY_ACTION, own), (F.ORACLE_ACTION, label),
                               (F.INTERVENTION, intervening), ("flags", info["label_flags"][0]),
                               (F.REWARD, reward[0]), (F.SUCCESS, success)):
                cols[key].append(value)
            if term[0] or trunc[0]:
                break
        ep = {k: np.asarray(v) for k, v in cols.items()}
        ep["obs"] = {k: np.stack(v) for k, v in seen.items()}
        ep.update(actor=self.actor_id, seed=int(seed), version=ran, eval=bool(evaluate), success=bool(success),
                  task=task, fps=self.fps)
        return ep


def start_learner(cfg: FleetConfig, share: Callable[[dict], Any], log: Callable[[str], None]) -> FleetLearner:
    """The learner, holding the base as version 0; its training process loads the original data."""
    from robopolicy.models.loading import load_policy

    hg = cfg.hg_dagger()
    policy = load_policy(cfg.base)
    if getattr(policy, "output", None) == "waypoints":
        raise ValueError("fleet: a waypoint policy cannot learn the operator's actions (use an action-chunk policy)")
    out = Path(cfg.out)
    learner = FleetLearner(policy, hg, out / "weights", cfg.dataset or out / "dataset", cfg.retrain_every, cfg.queue,
                           share, cfg.resume, cfg.vcodec, log, cfg.seed, cfg.threads)
    return learner.start()


def run_fleet(cfg: FleetConfig, log: Callable[[str], None] = print) -> dict:
    """Run the fleet for ``cfg.episodes`` episodes; returns the summary (also written to ``out``)."""
    from robopolicy.scale.fleet_report import report
    from robopolicy.scale.ray_backend import fit_workers, init_ray, run_pool

    started, t0 = time.time(), time.perf_counter()
    ray = init_ray(cfg.ray)
    learner = start_learner(cfg, ray.put, log)
    remote = ray.remote(num_cpus=cfg.ray.num_cpus_per_worker, max_restarts=0)(EpisodeRunner)
    made = [0]

    def make_actor():
        made[0] += 1
        return remote.remote(made[0] - 1, {"id": cfg.env.id, "kwargs": dict(cfg.env.kwargs)}, cfg.base, cfg.operator,
                             cfg.control_dt, cfg.steps_per_chunk, cfg.seed, cfg.threads)

    def call(actor, episode: int):
        version, weights = learner.current()
        return actor.run_episode.remote(cfg.seed + episode, version, weights, cfg.is_eval(episode))

    received = [0]

    def done(episode: int, ep: dict) -> None:
        learner.submit(ep)
        received[0] += 1
        if received[0] % max(1, cfg.episodes // 20) == 0:
            evals = [r["success"] for r in learner.rows if r["eval"]][-cfg.window:]
            log(f"[fleet] {received[0]}/{cfg.episodes} episodes run, {learner.stats.episodes} ingested, "
                f"v{learner.version}, labels {learner.stats.labels}, success (last {len(evals)} eval) "
                f"{np.mean(evals) if evals else float('nan'):.0%}, {learner.elapsed():.0f}s")

    log(f"[fleet] {cfg.actors} actors on Ray ({cfg.ray.address or 'this machine'}), base {cfg.base}, "
        f"{cfg.episodes} episodes, out {cfg.out}")
    try:
        pool = run_pool(make_actor, call, range(cfg.episodes), fit_workers(cfg.ray, cfg.actors, log), done)
    finally:
        learner.close(final_step=False)
    metrics = report(cfg, learner, pool, made[0], started, time.perf_counter() - t0, log)
    if cfg.version_episodes:
        evaluate_versions(cfg, log)
    return metrics


def evaluate_versions(cfg: FleetConfig, log: Callable[[str], None] = print) -> list[dict]:
    """Every version under ``<out>/weights`` on the same ``version_episodes`` seeds, the policy alone
    (in this process); writes ``versions_eval.csv``, redraws ``success.png`` with these points at
    each version's publishing time, and the record ``<out>/versions_eval/summary.json``."""
    from robopolicy.models.loading import load_policy
    from robopolicy.scale.fleet_learner import state_arrays
    from robopolicy.scale.fleet_report import report_versions

    started, out = time.time(), Path(cfg.out)
    episodes = cfg.version_episodes or 100
    paths = sorted((out / "weights").glob("v" + "[0-9]" * 6))
    if not paths:
        raise FileNotFoundError(f"{out / 'weights'}: no published versions (run robopolicy fleet first)")
    runner = EpisodeRunner(0, cfg.env, str(paths[0]), None, cfg.control_dt, cfg.steps_per_chunk, cfg.seed, cfg.threads)
    results = []
    for path in paths:
        version = int(path.name[1:])
        weights = state_arrays(load_policy(path)) if version > runner.version else None
        eps = [runner.run_episode(cfg.version_seed + i, version, weights, evaluate=True) for i in range(episodes)]
        results.append({"version": version, "success": float(np.mean([e["success"] for e in eps])),
                        "steps_mean": float(np.mean([len(e[F.ACTION]) for e in eps]))})
        log(f"[fleet] v{version}: success {results[-1]['success']:.1%} on seeds {cfg.version_seed}.."
            f"{cfg.version_seed + episodes - 1}")
    report_versions(cfg, results, episodes, started, log)
    return results
