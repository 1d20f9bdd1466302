"""On-policy relabelling with filtered oracle labels (DAgger family).

Read top to bottom: for each iteration: roll out the current policy mixed with the oracle (the
oracle's action executes with probability ``beta``, decayed each iteration) → the privileged
oracle labels every visited state → the filter drops states whose label is unreliable → the
kept states join the aggregate (all earlier iterations) → fine-tune the policy with its own
imitation loss on batches mixing the aggregate with the original dataset (``original``,
``original_fraction``) → evaluate → repeat. Observations keep the policy's temporal context
(frames at its strides within the visited episode), as the training loader builds them.

Labels: a waypoint policy learns the oracle's ``(K, 3)`` waypoints of the state. A chunk policy
learns, with ``chunk_labels: oracle``, the oracle's own next ``H`` actions from the state (a
counterfactual rollout in the env, which is then put back: the chunk the oracle would execute from
here), or with ``chunk_labels: along`` the oracle's labels of the next ``H`` states the rollout
visited (each label right for its state, but the states follow the policy's actions, not the
labels); both padded at the episode end.

The labeller may also be a policy that reads the privileged scene state (``collect``'s ``teacher``):
:mod:`robopolicy.refine.distill` teaches a camera student that way.

Perceive-then-act policies (a :class:`~robopolicy.models.modular.ModularPolicy` base,
``learner: locator``): the same loop relabels perception instead. At every visited state the env's
privileged scene label (the locator's ``locate_label``, e.g. ``label.goal_grip``: the named cube
from the gripper, the bowl) is the target of the locator's locate loss; the actor stays frozen.
This teaches the locator the states its own estimates lead the arm into, which labelled frames
recorded from the oracle or from random poses rarely show.

Filter (``filter`` list): ``target_lost`` (the target is out of sight and out of range: not
recoverable from here), ``near_collision`` (a person already within collision range: the
oracle cannot avoid it), ``target_unseen`` (the target is not in the current frame, occluded or
out of view: the label follows a person the policy cannot see, though its temporal context may
still hold it), ``pre_failure`` (the last ``pre_failure_steps`` states before an
episode that ended in collision or loss, all of them), ``unrecoverable`` (of those states, the ones
from which the oracle itself, taking over, collides or loses the target within
``recover_horizon`` steps: a counterfactual probe in the env, PersonFollow only). ``pre_failure``
also drops the states just before a failure that the oracle could still have saved, the ones
whose labels show the recovery; ``unrecoverable`` keeps those (the probe's "rescue" states).
``near_obstacle`` (the robot's rim within 0.5 m of an obstacle or wall) can be filtered too, though
its labels are sound: it exists to be weighted.

Weights (``weights``, flag → factor): fine-tuning draws a kept state in proportion to the product
of the factors of its flags, e.g. ``{rescue: 10}`` (the saveable states before a failure: failures
are few in the rollouts, 10–23 episodes in 6000 states measured on PersonFollow, and these labels
show how to avoid them) or ``{near_obstacle: 5}`` (the robot within 0.5 m of an obstacle or wall,
where the labels brake or turn away).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from hardware.control.chunking import ChunkExecutor
from robopolicy.data.features import ENV_STATE
from robopolicy.envs import EnvConfig
from robopolicy.eval.envs import make_task_envs
from robopolicy.eval.episodes import EvalResult, evaluate_success
from robopolicy.models.policy import Policy, PolicyError
from robopolicy.refine.common import Curve, RefineRunOptions
from robopolicy.refine.ray_rollouts import dagger_rollout, rollout_pool
from robopolicy.refine.summary import write_refine_summary
from robopolicy.scale.ray_backend import RayConfig
from sim_envs.wrappers import LABEL_FLAGS

FILTERS = (*LABEL_FLAGS, "pre_failure", "unrecoverable")
WEIGHTED = (*FILTERS, "rescue")


@dataclass
class DAggerConfig(RefineRunOptions):
    env: EnvConfig = field(default_factory=lambda: EnvConfig("robopolicy/PersonFollow-v0", {"split": "dt"}))
    base: str = ""
    """Policy checkpoint to refine (a ``Policy`` directory)."""
    iterations: int = 3
    steps_per_iteration: int = 2_000
    """Env steps collected per iteration (all envs together)."""
    num_envs: int = 2
    backend: str = "local"
    """Where the rollouts run: ``local`` (the envs in worker processes, the policy here) or ``ray``
    (one Ray worker per env running the policy, its chunk executor and the env, the weights pushed
    each iteration; ``robopolicy[scale]``). The same seed gives the same episodes either way."""
    ray: RayConfig = field(default_factory=RayConfig)
    """With ``backend: ray``: ``ray.address`` (None: a Ray started on this machine)."""
    beta0: float = 0.5
    """Probability that the oracle's action executes in iteration 0 (per step)..."""
    beta_decay: float = 0.5
    """... multiplied by this each iteration (DAgger's beta_i = beta0 * decay^i)."""
    filter: list[str] = field(default_factory=lambda: ["target_lost", "near_collision", "pre_failure"])
    """Label filters to apply (empty: keep every state)."""
    pre_failure_steps: int = 10
    """States before a failed episode's end that ``pre_failure`` drops and ``unrecoverable`` probes."""
    recover_horizon: int = 20
    """Steps the oracle must drive from a probed state without collision or loss to count as
    recoverable (``unrecoverable``)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Flag → how often a kept state with that flag is drawn for fine-tuning, relative to one
    without (factors multiply; empty: uniformly, DAgger as written). Flags: the label flags
    (``near_obstacle``: the robot within 0.5 m of an obstacle or wall), ``pre_failure`` and
    ``rescue`` (a failed episode's last ``pre_failure_steps`` states from which the oracle, taking
    over, still avoids the failure: probed as for ``unrecoverable``, PersonFollow only)."""
    replan: bool = True
    """The oracle re-anchors its plan to the robot's actual state before labelling it (see
    :attr:`sim_envs.core.Oracle.replan`; the arm oracle uses it; the tracking oracle re-plans from
    the observed state every step anyway). ``False``: the arm oracle labels along its own commanded
    path."""
    chunk_labels: str = "along"
    """A chunk policy's targets: ``along`` (the oracle's labels at the next H visited states) or
    ``oracle`` (the oracle's own next H actions from the state, a counterfactual rollout; envs with
    ``oracle_chunk``, i.e. the arm tasks)."""
    original: str = ""
    """LeRobot dataset the base was trained on: its frames are mixed into every fine-tuning batch
    (DAgger aggregates with the original data); empty: on-policy states only."""
    original_episodes: list[int] | None = None
    """Episodes of ``original`` to mix in (``None``: all), e.g. those the base was trained on."""
    original_action: str = "action"
    """Target key of ``original`` (``oracle.waypoints`` for a waypoint policy)."""
    original_fraction: float = 0.5
    """Share of each fine-tuning batch drawn from ``original``."""
    max_states: int = 0
    """Keep at most the newest this many labelled states in the aggregate (0: all of them, DAgger as
    written). With camera observations every state holds its frames (~55 kB at two 96 px cameras),
    so this bounds memory; it also keeps a fixed number of fine-tuning steps on the states the
    current policy visits instead of spreading them over every earlier iteration's."""
    learner: str = "auto"
    """What the labels train: ``policy`` (its actions, from the oracle) or ``locator`` (a modular
    base's locator, from the env's scene label; the actor is frozen). ``auto``: ``locator`` for a
    modular base, else ``policy``."""
    finetune_steps: int = 200
    batch_size: int = 32
    lr: float = 3e-5
    device: str = "auto"
    """Where fine-tuning runs: ``auto`` (CUDA when available), ``cpu``, ``cuda``, ``cuda:1``, ... The
    rollouts and evaluations run on the CPU beside the env workers (one observation per env at a
    time), so the policy moves to the device for each fine-tuning phase and back after it."""
    steps_per_chunk: int | None = None
    """Actions executed per predicted chunk (``None``: the whole chunk; waypoints: 1)."""
    out: str = "outputs/refine/dagger"

    def __post_init__(self):
        bad = [f for f in self.filter if f not in FILTERS]
        if bad:
            raise ValueError(f"dagger.filter: unknown {bad} (choose from {list(FILTERS)})")
        if self.pre_failure_steps < 0 or self.recover_horizon < 1:
            raise ValueError(f"dagger: pre_failure_steps must be >= 0 and recover_horizon >= 1, got "
                             f"{self.pre_failure_steps} and {self.recover_horizon}")
        bad = [k for k in self.weights if k not in WEIGHTED]
        if bad:
            raise ValueError(f"dagger.weights: unknown flag {bad} (choose from {list(WEIGHTED)})")
        bad = {k: w for k, w in self.weights.items() if not (isinstance(w, (int, float)) and 0 < w < float("inf"))}
        if bad:
            raise ValueError(f"dagger.weights: factors must be finite numbers > 0 (1: no weighting), got {bad}")
        if self.max_states < 0:
            raise ValueError(f"dagger.max_states must be >= 0 (0: keep every state), got {self.max_states}")
        if self.chunk_labels not in ("along", "oracle"):
            raise ValueError(f"dagger.chunk_labels: {self.chunk_labels!r} is not 'along' or 'oracle'")
        if self.learner not in LEARNERS:
            raise ValueError(f"dagger.learner: {self.learner!r} is not one of {list(LEARNERS)}")
        if self.backend not in ("local", "ray"):
            raise ValueError(f"dagger.backend: {self.backend!r} is not 'local' or 'ray'")


LEARNERS = ("auto", "policy", "locator")


def resolve_learner(policy, learner: str):
    """``(trainee, scene_label)``: the module the labels train and, for a locator, the label it
    estimates (``None`` for a policy learning actions)."""
    from robopolicy.models.modular import ModularPolicy

    modular = isinstance(policy, ModularPolicy)
    if not modular and not isinstance(policy, Policy):
        raise PolicyError(f"dagger: cannot relabel a {type(policy).__name__}; give a policy or a modular "
                          f"checkpoint as the base")
    if learner == "locator" and not modular:
        raise PolicyError("dagger.learner: locator needs a perceive-then-act (modular) base checkpoint")
    if learner == "policy" and modular:
        raise PolicyError("dagger.learner: policy cannot train a modular base's actions through its locator's "
                          "estimates; use learner: locator, or refine the actor checkpoint alone")
    if modular:
        return policy.locator, policy.locator.config.locate_label
    return policy, None


def policy_actor(policy, steps_per_chunk: int | None, waypoints: bool):
    """``act(obs) -> (N, A)`` executing the policy's chunks through the chunk executor (one row per
    env; ``robopolicy eval``'s :class:`~robopolicy.eval.policy_runner.PolicyActor`), and ``reset(rows)``."""
    from robopolicy.eval.policy_runner import PolicyActor, PolicyRunner

    kind = "waypoints" if waypoints else "action"
    actor = PolicyActor(PolicyRunner(policy), ChunkExecutor("chunk", None if waypoints else steps_per_chunk, kind=kind))
    return actor.act, actor.reset


def collect(policy, cfg: DAggerConfig, beta: float, rng: np.random.Generator, waypoints: int | None,
            scene_label: str | None = None, teacher=None, horizon: int | None = None, ends: list | None = None):
    """Roll out the beta-mixture for ``steps_per_iteration`` steps; returns the visited frames with
    oracle labels and filter flags (episodes in progress at the end are kept, unflagged), and with
    ``scene_label``'s value from the env's info under ``"scene"``. ``ends``, when given, gets
    (vector steps, frames so far) as each episode's frames are added (to merge the rows of Ray
    workers: :mod:`robopolicy.refine.ray_rollouts`).

    ``teacher``: labels from a policy that reads the privileged scene state instead of the env's
    oracle (:class:`robopolicy.refine.distill.PolicyTeacher`; the envs then add that state to the
    observation); its chunk of ``horizon`` actions (default: the policy's) is the frame's target.
    ``policy`` ``None``: the labeller drives alone (``beta`` must be 1)."""
    if policy is None and beta < 1.0:
        raise ValueError("collect: without a policy the labeller drives every step (beta 1)")
    act, reset = policy_actor(policy, cfg.steps_per_chunk, waypoints is not None) if policy else (None, _no_reset)
    probe = cfg.pre_failure_steps if _probes(cfg) else 0
    chunked = waypoints is None and not scene_label  # a chunk policy learning actions
    horizon = horizon or (policy.config.horizon if chunked else 0)
    chunk = horizon if chunked and cfg.chunk_labels == "oracle" and teacher is None else 0
    envs = make_task_envs(cfg.env, cfg.num_envs, reward="dense", oracle=teacher is None, waypoints=waypoints,
                          probe_window=probe, probe_horizon=cfg.recover_horizon, replan=cfg.replan,
                          label_chunk=chunk, privileged=teacher is not None)
    if teacher is not None:
        reset = teacher.wrap_reset(reset)
    n = cfg.num_envs
    scene_key = scene_label.removeprefix("label.") if scene_label else None
    episodes: list[list[dict]] = [[] for _ in range(n)]
    frames: list[dict] = []
    try:
        obs, info = envs.reset(seed=[int(rng.integers(1 << 30)) + i for i in range(n)])
        if scene_key and scene_key not in info:
            raise PolicyError(f"dagger: the env reports no {scene_key!r} in its info, so it cannot label the "
                              f"locator's {scene_label!r}")
        reset(list(range(n)))
        steps = 0
        while steps < cfg.steps_per_iteration:
            if teacher is not None:
                taught = teacher.chunks(obs, horizon)
                info = dict(info, oracle_label=taught[:, 0], oracle_chunk=taught, oracle_chunk_len=[horizon] * n,
                            label_flags=np.zeros((n, len(LABEL_FLAGS)), np.float32))
            label = info["oracle_waypoints"] if waypoints is not None else info["oracle_label"]
            own = act(obs) if act is not None else label
            oracle_exec = rng.random(n) < beta
            action = np.where(oracle_exec.reshape((n,) + (1,) * (own.ndim - 1)), label, own).astype(np.float32)
            for i in range(n):
                episodes[i].append({"obs": {k: np.array(v[i]) if k != "task" else str(v[i]) for k, v in obs.items()},
                                    "label": np.array(info["oracle_label"][i]),
                                    "waypoints": np.array(label[i]) if waypoints is not None else None,
                                    "flags": np.array(info["label_flags"][i]),
                                    "scene": np.array(info[scene_key][i]) if scene_key else None,
                                    "chunk": np.array(info["oracle_chunk"][i][:int(info["oracle_chunk_len"][i])])
                                    if chunk or teacher is not None else None})
            obs, _r, term, trunc, info = envs.step(action)
            steps += n
            done = np.logical_or(term, trunc)
            if done.any():
                final = info["final_info"]
                for i in np.flatnonzero(done):
                    failed = _failed(final, int(i))
                    n_ep = len(episodes[i])
                    for j, fr in enumerate(episodes[i]):
                        fr["pre_failure"] = failed and j >= n_ep - cfg.pre_failure_steps
                        fr["unrecoverable"] = bool(probe and j >= n_ep - probe
                                                   and final["unrecoverable"][i][probe - n_ep + j] > 0)
                        fr["rescue"] = bool(probe and failed and j >= n_ep - probe and not fr["unrecoverable"])
                    frames += _with_chunks(episodes[i])
                    if ends is not None:
                        ends.append((steps // n, len(frames)))
                    episodes[i] = []
                reset([int(i) for i in np.flatnonzero(done)])
    finally:
        envs.close()
    for ep in episodes:
        for fr in ep:
            fr["pre_failure"] = fr["unrecoverable"] = fr["rescue"] = False
        frames += _with_chunks(ep)
    return frames


def _no_reset(rows) -> None:
    """The reset of a rollout without a policy (the labeller drives)."""


def _probes(cfg: DAggerConfig) -> bool:
    """Whether the rollouts probe the states before each failure (``unrecoverable``, rescue states)."""
    return "unrecoverable" in cfg.filter or cfg.weights.get("rescue", 1.0) != 1.0


def has_flag(frame: dict, flag: str) -> bool:
    """Whether ``frame`` carries ``flag`` (a label flag, or a mark set at its episode's end)."""
    if flag in LABEL_FLAGS:
        return bool(frame["flags"][LABEL_FLAGS.index(flag)] > 0)
    return bool(frame.get(flag, False))


def draw_weight(frame: dict, weights: dict[str, float]) -> float:
    """How often fine-tuning draws ``frame``, relative to an unflagged state: the product of the
    ``weights`` of the flags it carries."""
    return float(np.prod([w for flag, w in weights.items() if has_flag(frame, flag)]))


def _failed(final: dict, i: int) -> bool:
    em = final.get("episode_metrics")
    if isinstance(em, dict):  # vector info: a dict of arrays
        return bool(np.asarray(em.get("collision", [False] * (i + 1)))[i] or np.asarray(em.get("lost", [False] * (i + 1)))[i])
    return False


def _with_chunks(episode: list[dict]) -> list[dict]:
    """Attach each frame's target chunk (for chunk policies: the oracle's counterfactual chunk where
    it was collected, else the labels of this and the later states along the trajectory) and its
    place in the episode (for the temporal context of the observation)."""
    labels = np.stack([f["label"] for f in episode]) if episode else None
    for j, f in enumerate(episode):
        f["future"] = labels[j:] if f.get("chunk") is None else f["chunk"]
        f["episode"], f["index"] = episode, j
    return episode


def keep(frame: dict, filters: list[str]) -> bool:
    """Whether the filter keeps this state's label."""
    return not any(has_flag(frame, f) for f in filters)


def flag_counts(frames: list[dict]) -> dict[str, int]:
    """How many of ``frames`` each filter would drop, applied or not, and how many are rescue
    states (``unrecoverable`` and ``rescue`` are only known where the end was probed)."""
    return {f: sum(has_flag(fr, f) for fr in frames) for f in WEIGHTED}


def make_batch(frames: list[dict], policy, scene_label: str | None = None) -> dict:
    """Aggregated frames → a loader-style batch for ``policy.losses``: the observation at the
    policy's context strides (frames before the episode start repeat the first one, flagged as
    padding, as the training loader does; a frame's cached ``features`` ``(V, n, C)`` stand for its
    camera images), and the target: the action chunk or waypoints, or with ``scene_label`` that
    label ``(B, D)`` (a locator's)."""
    strides = list(policy.config.context_strides)
    ctx = [[f.get("episode", [f])[max(f.get("index", 0) - s, 0)] for s in strides] for f in frames]
    out: dict = {"task": [f["obs"].get("task", "") for f in frames]}  # PointReach has no instruction
    if "features" in frames[0]:  # a frozen encoder's features, encoded once (in place of the frames)
        out["features"] = torch.from_numpy(np.stack([[c["features"] for c in row] for row in ctx])).float()
    for key in frames[0]["obs"]:
        if key.startswith("observation.images."):
            out[key] = torch.from_numpy(np.stack([[c["obs"][key] for c in row] for row in ctx])).permute(0, 1, 4, 2, 3)
        elif key == "observation.state":
            out[key] = torch.from_numpy(np.stack([[c["obs"][key] for c in row] for row in ctx]).astype(np.float32))
        elif key == ENV_STATE and policy.config.env_state_dim:  # read at t, as the trainer loads it
            out[key] = torch.from_numpy(np.stack([f["obs"][key] for f in frames]).astype(np.float32))
    out["observation_is_pad"] = torch.tensor([[f.get("index", 0) - s < 0 for s in strides] for f in frames])
    if getattr(policy.config, "condition_on_rating", False):  # a relabelled frame is a good example
        from robopolicy.teleop.ratings import RATING_INDEX

        out["rating"] = torch.full((len(frames),), RATING_INDEX["good"], dtype=torch.long)
    if scene_label is not None:
        out[scene_label] = torch.from_numpy(np.stack([f["scene"] for f in frames]).astype(np.float32))
    elif policy.output == "waypoints":
        out["action"] = torch.from_numpy(np.stack([f["waypoints"] for f in frames]).astype(np.float32))[:, None]
    else:
        h = policy.config.horizon
        known = np.array([min(len(f["future"]), h) for f in frames])
        out["action"] = torch.from_numpy(target_chunks(frames, h))
        out["action_is_pad"] = torch.from_numpy(np.arange(h)[None] >= known[:, None])
    return out


def target_chunks(frames: list[dict], horizon: int) -> np.ndarray:
    """The frames' target chunks ``(N, horizon, A)`` float32, the last action repeated past an episode's end."""
    out = []
    for f in frames:
        fut = f["future"][:horizon]
        out.append(np.concatenate([fut, np.repeat(fut[-1:], horizon - len(fut), 0)]))
    return np.stack(out).astype(np.float32)


def original_dataset(cfg: DAggerConfig, policy, scene_label: str | None = None):
    """The base's training data as a loader dataset (``None`` when ``cfg.original`` is empty); with
    ``scene_label`` (a locator's), that label is loaded too."""
    if not cfg.original:
        return None
    from robopolicy.data.loader import TrainingDataset

    waypoints = policy.output == "waypoints"
    labels = [ENV_STATE] if policy.config.env_state_dim else []
    return TrainingDataset(cfg.original, cameras=policy.cameras,
                           state_key="observation.state" if policy.config.use_state else None,
                           labels=labels + ([scene_label] if scene_label else []),
                           action_key=cfg.original_action, context_strides=policy.config.context_strides,
                           horizon=1 if waypoints or scene_label else policy.config.horizon,
                           episodes=cfg.original_episodes, progress=False)


def _mix(batch: dict, original, n: int, rng: random.Random) -> dict:
    """Append ``n`` random samples of the original dataset to an on-policy batch."""
    from torch.utils.data import default_collate

    keys = [k for k in batch if k != "task"]
    items = [original[rng.randrange(len(original))] for _ in range(n)]
    extra = default_collate([{k: it[k] for k in keys if k in it} for it in items])
    out = {k: torch.cat([batch[k], extra[k].to(batch[k].dtype)]) if k in extra else batch[k] for k in keys}
    out["task"] = list(batch["task"]) + [it["task"] for it in items]
    return out


def finetune(policy, data: list[dict], cfg: DAggerConfig, rng: random.Random, original=None,
             scene_label: str | None = None, bar=None) -> float:
    """A few imitation steps on the aggregate (the locate loss on ``scene_label`` when given, else
    the action loss); returns the mean loss of the last 20 steps. ``bar``: a tqdm bar to advance."""
    from robopolicy.train.trainer import _to_device, resolve_device

    device = resolve_device(cfg.device)
    policy.to(device)
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr)
    policy.train()
    losses = []
    n_orig = int(round(cfg.batch_size * cfg.original_fraction)) if original is not None else 0
    weights = [draw_weight(f, cfg.weights) for f in data]
    weighted = any(w != 1.0 for w in weights)
    for _ in range(cfg.finetune_steps):
        k = min(cfg.batch_size - n_orig, len(data))
        picked = rng.choices(data, weights, k=k) if weighted else rng.sample(data, k)
        batch = make_batch(picked, policy, scene_label)
        if n_orig:
            batch = _mix(batch, original, n_orig, rng)
        batch = _to_device(batch, device)
        loss = policy.losses(batch, {"locate" if scene_label else "action": 1.0})["total"]
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
    policy.eval()
    policy.to("cpu")
    return float(np.mean(losses[-20:])) if losses else float("nan")


def evaluate(policy, cfg: DAggerConfig, waypoints: int | None, env: EnvConfig | None = None) -> EvalResult:
    """The policy alone on ``eval_episodes`` episodes from ``eval_seed``, in ``env`` (``None``: ``cfg.env``)."""
    act, reset = policy_actor(policy, cfg.steps_per_chunk, waypoints is not None)
    return evaluate_success(act, reset, env or cfg.env, cfg.eval_episodes, cfg.eval_envs, cfg.eval_seed,
                            waypoints=waypoints)


def train(cfg: DAggerConfig, policy=None, log: Callable[[str], None] = print) -> dict:
    """Run DAgger; returns a summary and saves the refined policy under ``out/final`` (the
    last iteration's) and ``out/best`` (the best evaluated, when it beats the base)."""
    from tqdm.auto import tqdm

    from robopolicy.models.loading import load_policy
    from robopolicy.train.trainer import resolve_device

    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    rng, prng = np.random.default_rng(cfg.seed), random.Random(cfg.seed)
    device = resolve_device(cfg.device)  # a device that is not there stops the run before any rollout
    policy = policy or load_policy(cfg.base)
    trainee, scene_label = resolve_learner(policy, cfg.learner)
    waypoints = policy.horizon if policy.output == "waypoints" else None
    out = Path(cfg.out)
    curve = Curve(out, "curve")
    t0, started = time.perf_counter(), time.time()
    before = evaluate(policy, cfg, waypoints)
    curve.add(0, before.success, **before.metrics)
    log(f"[dagger] before: success {before.success:.1%} {before.metrics}; fine-tuning on {device}")
    original = original_dataset(cfg, trainee, scene_label)
    data: list[dict] = []
    env_steps, counterfactual, dropped, flagged = 0, 0, 0, dict.fromkeys(WEIGHTED, 0)
    seconds = dict.fromkeys(("rollout", "finetune", "eval"), 0.0)  # wall clock by phase, iterations only
    with rollout_pool(cfg, policy) as pool:  # Ray workers holding the policy (backend: ray), else None
        bar = tqdm(total=cfg.iterations * cfg.finetune_steps, unit="step", disable=not cfg.progress, dynamic_ncols=True)
        for it in range(cfg.iterations):
            beta = cfg.beta0 * cfg.beta_decay**it
            bar.set_description(f"iteration {it}: rolling out")
            t = time.perf_counter()
            frames = (collect(policy, cfg, beta, rng, waypoints, scene_label) if pool is None
                      else dagger_rollout(pool, policy, cfg, beta, rng, waypoints, scene_label))
            seconds["rollout"] += time.perf_counter() - t
            env_steps += len(frames)
            counterfactual += sum(len(f["chunk"]) - 1 for f in frames if f.get("chunk") is not None)
            kept = [f for f in frames if keep(f, cfg.filter)]
            dropped += len(frames) - len(kept)
            for f, c in flag_counts(frames).items():
                flagged[f] += c
            data += kept
            if cfg.max_states and len(data) > cfg.max_states:
                data = data[-cfg.max_states:]
            bar.set_description(f"iteration {it}: fine-tuning")
            t = time.perf_counter()
            loss = finetune(trainee, data, cfg, prng, original, scene_label, bar) if data else float("nan")
            seconds["finetune"] += time.perf_counter() - t
            bar.set_description(f"iteration {it}: evaluating")
            t = time.perf_counter()
            res = evaluate(policy, cfg, waypoints)
            seconds["eval"] += time.perf_counter() - t
            curve.add(env_steps, res.success, **res.metrics)
            if curve.is_best() and res.success > before.success:
                policy.save(out / "best")
            bar.clear()  # the line goes above the bar, not into it
            marks = dict.fromkeys([*cfg.weights, *(["rescue"] if _probes(cfg) else [])])
            rescued = f" ({', '.join(f'{sum(has_flag(x, f) for x in kept)} {f}' for f in marks)})" if marks else ""
            log(f"[dagger] iteration {it}: beta {beta:.3g}, kept {len(kept)}/{len(frames)} states{rescued}, aggregate "
                f"{len(data)}, loss {loss:.4f}, success {res.success:.1%} {res.metrics} (so far: rollouts "
                f"{seconds['rollout']:.0f} s, fine-tuning {seconds['finetune']:.0f} s, evaluations {seconds['eval']:.0f} s)")
            bar.refresh()
        bar.close()
    policy.save(out / "final")
    summary = {"before": before.success, "before_metrics": before.metrics, "after": curve.rows[-1]["success"],
               "after_metrics": {k: v for k, v in curve.rows[-1].items() if k not in ("env_steps", "success")},
               "env_steps": env_steps, "counterfactual_steps": counterfactual,
               "dropped_states": dropped, "kept_states": env_steps - dropped, "flagged_states": flagged,
               "rescue_states": sum(bool(f.get("rescue")) for f in data), "weights": dict(cfg.weights),
               "weighted_states": {k: sum(has_flag(f, k) for f in data) for k in cfg.weights},
               "aggregate_states": len(data), "rollout_reruns": pool.stats.reruns if pool is not None else 0,
               "filter": list(cfg.filter), "learner": "locator" if scene_label else "policy",
               **curve.best_summary(above=before.success),
               "seconds": time.perf_counter() - t0, "seconds_by_phase": seconds, "device": str(device),
               "checkpoint": str(out / "final")}
    write_refine_summary(cfg, summary, started)
    return summary
