"""Where a PickPlace policy fails, and what a perfect gripper release would add.

    .venv/bin/python bench/pickplace_failures.py checkpoint=outputs/train/arm_state_75/final
    .venv/bin/python bench/pickplace_failures.py checkpoint=outputs/train/arm_state_75/final release=step
    .venv/bin/python bench/pickplace_failures.py checkpoint=outputs/refine/residual_pp_switch/final release=chunk
    .venv/bin/python bench/pickplace_failures.py checkpoint=outputs/train/arm_state_75/final execute_steps=16 grasp_offsets=true

Runs a state-based ArmPickPlace policy (a plain chunk checkpoint, executed as residual PPO's
rollouts execute it: ``execute_steps`` actions per chunk, from ``config``; or a residual
checkpoint, deterministic) on the evaluation seeds and sorts every episode by how it ended:

- ``success``;
- ``never lifted``: the named cube never rose 2 cm off the table;
- ``held over the bowl``: at the time limit the cube is still in the gripper, above the bowl;
- ``held elsewhere``: still in the gripper, not above the bowl;
- ``dropped or placed outside``: on the table (or the bowl's rim) outside the success radius.

``release`` is the anchor for a gripper residual: ``step`` forces the gripper fully open on every
step where the lifted cube is within 2 cm (xy) of the bowl's centre, ``chunk`` does so only where
a residual with ``decision: chunk`` decides and holds it for that chunk (what a switch residual,
``residual.switch_dims``, can do at best with this rule; on a residual checkpoint the rule
overrides its gripper). The success gain is the share of the
base's failures that a release alone fixes. For a residual checkpoint with switch dimensions it
also prints how likely the residual makes "open" in those states. ``counterfactual=true`` asks
what a release would do where it matters: every episode is replayed once per decision where the
held cube is over the bowl, the gripper forced open over that decision's chunk only (the env and
the policy are deterministic, so the replay is the same episode up to there).
``grasp_offsets=true`` asks the same of a Cartesian correction (what ``residual.tcp`` can do): every
episode that never lifts the cube is replayed once per constant xy offset of the commanded
tool-centre point (a 5 x 5 grid, ±``offset`` metres), applied until the cube is first lifted.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from robopolicy.config import load_config  # noqa: E402
from sim_envs.arm import so101  # noqa: E402

LIFTED = so101.CUBE_HALF + 0.0075  # cube centre height (m) that counts as lifted (it rests at CUBE_HALF)
NEAR = 0.02  # xy distance (m) of the cube from the bowl's centre where the release rule opens


@dataclass
class FailureBenchConfig:
    checkpoint: str = ""
    """A plain state-based PickPlace chunk policy, or a residual checkpoint over one."""
    config: str = "configs/refine/residual_ppo_pp_state_chunk.yaml"
    """Residual config of a plain checkpoint's rollouts (env kwargs, execute_steps, decision)."""
    execute_steps: int = 0
    """Actions executed per base chunk, replacing the config's (0: the config's; 16: whole chunks)."""
    episodes: int = 100
    seed: int = 100_000
    release: str = "none"
    """``none``, ``step`` or ``chunk`` (see the module docstring)."""
    counterfactual: bool = False
    """Also replay each episode once per decision where the held cube is over the bowl, the release
    forced over that decision's chunk only (``decision: chunk``; with ``release=none``)."""
    grasp_offsets: bool = False
    """Also replay each never-lifted episode once per xy offset of the commanded tool-centre point,
    held until the cube is lifted (with ``release=none``)."""
    offset: float = 0.01
    """Largest grasp offset (m) of that grid."""


def classify(success: bool, max_z: float, z: float, dist: float) -> str:
    if success:
        return "success"
    if max_z < LIFTED:
        return "never lifted"
    if z > LIFTED:
        return "held over the bowl" if dist < so101.BOWL_RADIUS else "held elsewhere"
    return "dropped or placed outside"


def main(argv: list[str]) -> int:
    from pathlib import Path

    from robopolicy.refine.common import make_refine_env
    from robopolicy.refine.residual import RESIDUAL_CONFIG, load_any_policy
    from robopolicy.refine.residual_ppo import ResidualPPOConfig, build_policy, env_kwargs

    cfg = load_config(FailureBenchConfig, None, argv)
    if not cfg.checkpoint:
        raise SystemExit("give checkpoint=DIR")
    if cfg.release not in ("none", "step", "chunk"):
        raise SystemExit(f"release must be none, step or chunk, got {cfg.release!r}")
    torch.set_num_threads(1)
    is_residual = (Path(cfg.checkpoint) / RESIDUAL_CONFIG).is_file()
    rcfg = load_config(ResidualPPOConfig, cfg.config, [] if is_residual else [f"base={cfg.checkpoint}"])
    if cfg.execute_steps and not is_residual:
        rcfg.residual.execute_steps = cfg.execute_steps
    policy = load_any_policy(cfg.checkpoint) if is_residual else build_policy(rcfg)
    if is_residual:
        rcfg.residual = policy.config
    if "pickplace" not in rcfg.env.id.lower():
        raise SystemExit(f"{cfg.config}: env {rcfg.env.id} is not ArmPickPlace")
    if (cfg.release == "chunk" or cfg.counterfactual) and policy.config.decision != "chunk":
        raise SystemExit("release=chunk and counterfactual=true need residual.decision: chunk")
    if (cfg.counterfactual or cfg.grasp_offsets) and cfg.release != "none":
        raise SystemExit("counterfactual=true and grasp_offsets=true replay the policy's own episodes: use them "
                         "with release=none")
    env = make_refine_env(rcfg.env, **env_kwargs(rcfg))
    high = float(env.action_space.high[5])
    arm = None
    if cfg.grasp_offsets:
        from sim_envs.arm.ik import ArmIK

        arm = ArmIK()

    def episode(seed: int, force_at: int = -1, grasp_shift: np.ndarray | None = None) -> dict:
        """One deterministic episode; ``force_at`` >= 0: force the release over that decision's chunk;
        ``grasp_shift``: move the commanded tool-centre point by it (m) until the cube is lifted."""
        obs, info = env.reset(seed=seed)
        policy.reset()
        max_z, term, trunc, release_now, decision = 0.0, False, False, False, -1
        over_decisions, p_open = [], []
        while not (term or trunc):
            batch = {k: (torch.as_tensor(np.asarray(v))[None] if not isinstance(v, str) else [v]) for k, v in obs.items()}
            scene = np.asarray(obs["observation.environment_state"])
            over = scene[5] > LIFTED and float(np.linalg.norm(scene[3:5] - scene[8:10])) < NEAR
            with torch.no_grad():
                x, base_norm = policy.residual_input(batch)
                dist = policy.dist(policy.norm(x))
                r = dist.mode(policy.bounded) if is_residual else torch.zeros_like(base_norm)
                decides = bool(policy.decides[0])
                if dist.logits is not None and 5 in policy.switch and over and decides:
                    p_open.append(float(dist.logits[0, policy.switch.index(5)].softmax(-1)[2]))
                action = policy.env_action(base_norm, policy.hold(r)).numpy()[0]
            if decides:
                decision += 1
                if over:
                    over_decisions.append(decision)
            if cfg.release == "step" or decides:  # release=chunk / force_at: decided with the chunk, held over it
                release_now = over if cfg.release != "none" else decision == force_at
            if release_now:
                action[5] = high
            if grasp_shift is not None and max_z < LIFTED:
                action = action.astype(np.float64)
                action[:4] += arm.joint_shift(action[:5], grasp_shift)
                action = np.clip(action, env.action_space.low, env.action_space.high)
            obs, _r, term, trunc, info = env.step(action)
            scene = np.asarray(obs["observation.environment_state"])
            max_z = max(max_z, float(scene[5]))
        kind = classify(bool(info.get("is_success")), max_z, float(scene[5]),
                        float(np.linalg.norm(scene[3:5] - scene[8:10])))
        return {"kind": kind, "over": over_decisions, "p_open": p_open}

    counts: dict[str, int] = {}
    p_open: list[float] = []
    forced: dict[bool, list[bool]] = {True: [], False: []}  # base outcome -> outcomes with the release forced
    grid = np.linspace(-cfg.offset, cfg.offset, 5)
    shifted: list[int] = []  # per never-lifted episode: how many grid offsets succeed
    for e in tqdm(range(cfg.episodes), desc="episodes", unit="ep"):
        res = episode(cfg.seed + e)
        counts[res["kind"]] = counts.get(res["kind"], 0) + 1
        p_open += res["p_open"]
        if cfg.counterfactual:
            for k in res["over"]:
                forced[res["kind"] == "success"].append(episode(cfg.seed + e, force_at=k)["kind"] == "success")
        if cfg.grasp_offsets and res["kind"] == "never lifted":
            shifted.append(sum(episode(cfg.seed + e, grasp_shift=np.array([dx, dy, 0.0]))["kind"] == "success"
                               for dx in grid for dy in grid))
    n = cfg.episodes
    print(f"\n| {cfg.checkpoint} (release: {cfg.release}) | episodes | share |\n|---|---:|---:|")
    for kind in ("success", "never lifted", "held over the bowl", "held elsewhere", "dropped or placed outside"):
        print(f"| {kind} | {counts.get(kind, 0)} | {counts.get(kind, 0) / n:.0%} |")
    if p_open:
        print(f"\nP(open) where the held cube is over the bowl ({len(p_open)} decisions): mean {np.mean(p_open):.3f}, "
              f"median {np.median(p_open):.3f}")
    for won, outcomes in forced.items():
        if outcomes:
            print(f"release forced at one decision with the held cube over the bowl, in episodes the policy "
                  f"{'wins' if won else 'loses'}: {np.mean(outcomes):.0%} succeed ({len(outcomes)} decisions)")
    if shifted:
        fixed = sum(k > 0 for k in shifted)
        print(f"grasp offsets (xy grid of 25 within ±{cfg.offset * 100:.1f} cm, until the lift): {fixed} of "
              f"{len(shifted)} never-lifted episodes succeed with at least one; {np.mean(shifted) / 25:.0%} of the "
              f"offsets succeed on average")
    print(f"[failures] {cfg.checkpoint}: success {counts.get('success', 0) / n:.0%} of {n} "
          f"(release: {cfg.release})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
