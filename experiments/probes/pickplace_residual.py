"""The residual's side of a PickPlace failure breakdown: what a gripper switch or a tool-point
residual does where it matters. ``robopolicy diagnose pickplace-failures`` is the breakdown itself
(how episodes end, ``release=step``, ``correct``, ``grasp_offsets``) for any checkpoint; this probe
reaches into a residual policy's parts (its decisions, its switch logits, its tool-point shift),
so it follows that class and is not maintained as an interface.

    .venv/bin/python experiments/probes/pickplace_residual.py checkpoint=outputs/refine/residual_pp_switch/final release=chunk
    .venv/bin/python experiments/probes/pickplace_residual.py checkpoint=outputs/train/arm_state_75/final counterfactual=true
    .venv/bin/python experiments/probes/pickplace_residual.py checkpoint=outputs/refine/residual_pp_tcp/final

Runs a state-based ArmPickPlace policy (a plain chunk checkpoint, executed as residual PPO's
rollouts execute it: ``execute_steps`` actions per chunk, from ``config``; or a residual
checkpoint, deterministic) on the evaluation seeds and sorts every episode as the diagnosis does.

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

``correct`` applies the scripted corrections of
:class:`robopolicy.diagnose.pickplace_failures.Corrections` (``center``, ``narrow``, ``roll``,
``carry``) on top of the policy's action.

Every run also counts, among the ``dropped`` episodes, those whose cube was lifted for fewer than
5 steps: knocked or tipped at the grasp rather than lost on the way. On a residual that moves the
tool point (``residual.tcp``) it also measures how much of the ``center`` correction the residual
makes by itself: over the steps where ``center`` would act on the base's command, the least-squares
fit, per axis, of the residual's shift of the commanded tool point on the shift the ``center``
rule would make to the base's command (the cube's xy minus the command's, at most
``correct_range``): a slope of 1 is the scripted rule, 0 no centring at all.
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
from robopolicy.diagnose.pickplace_failures import KINDS, LIFTED, NEAR, Corrections, classify  # noqa: E402
from robopolicy.diagnose.pickplace_failures import clip_norm as _clip_norm  # noqa: E402


@dataclass
class FailureBenchConfig:
    checkpoint: str = ""
    """A plain state-based PickPlace chunk policy, or a residual checkpoint over one."""
    config: str = "experiments/configs/refine/residual_ppo_pp_state_chunk.yaml"
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
    correct: str = ""
    """Scripted corrections (``center``, ``narrow``, ``roll``, ``carry``; see the module docstring)."""
    correct_range: float = 0.02
    """Largest xy shift (m) of the ``center`` and ``carry`` corrections."""
    correct_every: int = 1
    """Recompute the ``center`` / ``carry`` shift every this many steps and hold it in between
    (what a residual with ``decision_every`` k can do at best with these rules)."""


def main(argv: list[str]) -> int:
    from pathlib import Path

    from robopolicy.eval.envs import make_task_env
    from robopolicy.models.loading import checkpoint_type, load_policy
    from robopolicy.refine.residual_ppo import ResidualPPOConfig, build_policy, env_kwargs

    cfg = load_config(FailureBenchConfig, None, argv)
    if not cfg.checkpoint:
        raise SystemExit("give checkpoint=DIR")
    if cfg.correct_every < 1:
        raise SystemExit(f"correct_every must be >= 1, got {cfg.correct_every}")
    if cfg.release not in ("none", "step", "chunk"):
        raise SystemExit(f"release must be none, step or chunk, got {cfg.release!r}")
    torch.set_num_threads(1)
    is_residual = checkpoint_type(cfg.checkpoint) == "residual"
    rcfg = load_config(ResidualPPOConfig, cfg.config, [] if is_residual else [f"base={cfg.checkpoint}"])
    if cfg.execute_steps and not is_residual:
        rcfg.residual.execute_steps = cfg.execute_steps
    policy = load_policy(cfg.checkpoint) if is_residual else build_policy(rcfg)
    if is_residual:
        rcfg.residual = policy.config
    if "pickplace" not in rcfg.env.id.lower():
        raise SystemExit(f"{cfg.config}: env {rcfg.env.id} is not ArmPickPlace")
    if (cfg.release == "chunk" or cfg.counterfactual) and policy.config.decision != "chunk":
        raise SystemExit("release=chunk and counterfactual=true need residual.decision: chunk")
    corrections = [c for c in cfg.correct.split(",") if c]
    unknown = set(corrections) - {"center", "narrow", "roll", "carry"}
    if unknown:
        raise SystemExit(f"correct: unknown {sorted(unknown)} (choose from center, narrow, roll, carry)")
    if (cfg.counterfactual or cfg.grasp_offsets) and cfg.release != "none":
        raise SystemExit("counterfactual=true and grasp_offsets=true replay the policy's own episodes: use them "
                         "with release=none")
    env = make_task_env(rcfg.env, **env_kwargs(rcfg))
    high = float(env.action_space.high[5])
    arm = None
    centring = is_residual and bool(policy.config.tcp)
    if cfg.grasp_offsets or corrections or centring:
        from sim_envs.arm.ik import ArmIK

        arm = ArmIK()

    corrected = Corrections(corrections, cfg.correct_range, cfg.correct_every) if corrections else None

    def episode(seed: int, force_at: int = -1, grasp_shift: np.ndarray | None = None) -> dict:
        """One deterministic episode; ``force_at`` >= 0: force the release over that decision's chunk;
        ``grasp_shift``: move the commanded tool-centre point by it (m) until the cube is lifted."""
        obs, info = env.reset(seed=seed)
        policy.reset()
        max_z, term, trunc, release_now, decision, lifted_steps, t = 0.0, False, False, False, -1, 0, 0
        over_decisions, p_open, centre = [], [], []
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
                held_r = policy.hold(r)
                action = policy.env_action(base_norm, held_r).numpy()[0]
                if centring and scene[5] < LIFTED:
                    base = policy.env_action(base_norm, torch.zeros_like(held_r)).numpy()[0].astype(np.float64)
                    cmd = arm.fk(base[:5])[0]
                    if cmd[2] < scene[5] + 0.05 and np.linalg.norm(cmd[:2] - scene[3:5]) < 0.04:
                        shift = arm.fk(action[:5].astype(np.float64))[0][:2] - cmd[:2]
                        centre.append((_clip_norm(scene[3:5] - cmd[:2], cfg.correct_range), shift))
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
            if corrections:
                action = np.clip(corrected(action, np.asarray(obs["observation.state"]), scene, info, t),
                                 env.action_space.low, env.action_space.high)
            t += 1
            obs, _r, term, trunc, info = env.step(action)
            scene = np.asarray(obs["observation.environment_state"])
            max_z = max(max_z, float(scene[5]))
            lifted_steps += int(scene[5] > LIFTED)
        kind = classify(bool(info.get("is_success")), max_z, float(scene[5]),
                        float(np.linalg.norm(scene[3:5] - scene[8:10])))
        return {"kind": kind, "over": over_decisions, "p_open": p_open, "lifted_steps": lifted_steps,
                "centre": centre}

    counts: dict[str, int] = {}
    p_open: list[float] = []
    forced: dict[bool, list[bool]] = {True: [], False: []}  # base outcome -> outcomes with the release forced
    grid = np.linspace(-cfg.offset, cfg.offset, 5)
    shifted: list[int] = []  # per never-lifted episode: how many grid offsets succeed
    centre: list[tuple[np.ndarray, np.ndarray]] = []  # (center rule's shift, residual's shift) per approach step
    knocked = 0  # dropped episodes whose cube was lifted for fewer than 5 steps
    for e in tqdm(range(cfg.episodes), desc="episodes", unit="ep"):
        res = episode(cfg.seed + e)
        counts[res["kind"]] = counts.get(res["kind"], 0) + 1
        p_open += res["p_open"]
        centre += res["centre"]
        knocked += res["kind"] == "dropped or placed outside" and res["lifted_steps"] < 5
        if cfg.counterfactual:
            for k in res["over"]:
                forced[res["kind"] == "success"].append(episode(cfg.seed + e, force_at=k)["kind"] == "success")
        if cfg.grasp_offsets and res["kind"] == "never lifted":
            shifted.append(sum(episode(cfg.seed + e, grasp_shift=np.array([dx, dy, 0.0]))["kind"] == "success"
                               for dx in grid for dy in grid))
    n = cfg.episodes
    print(f"\n| {cfg.checkpoint} (release: {cfg.release}) | episodes | share |\n|---|---:|---:|")
    for kind in KINDS:
        print(f"| {kind} | {counts.get(kind, 0)} | {counts.get(kind, 0) / n:.0%} |")
    if counts.get("dropped or placed outside"):
        print(f"\nof the {counts['dropped or placed outside']} dropped: {knocked} lifted for fewer than 5 steps "
              "(knocked or tipped at the grasp)")
    if p_open:
        print(f"\nP(open) where the held cube is over the bowl ({len(p_open)} decisions): mean {np.mean(p_open):.3f}, "
              f"median {np.median(p_open):.3f}")
    for won, outcomes in forced.items():
        if outcomes:
            print(f"release forced at one decision with the held cube over the bowl, in episodes the policy "
                  f"{'wins' if won else 'loses'}: {np.mean(outcomes):.0%} succeed ({len(outcomes)} decisions)")
    if len(centre) > 2:
        rule, made = (np.array(v) * 1000 for v in zip(*centre))
        fits = []
        for i, axis in enumerate("xy"):
            slope, icept = np.polyfit(rule[:, i], made[:, i], 1)
            left = float(np.abs(rule[:, i] - made[:, i]).mean())
            fits.append(f"{axis}: {slope:.2f} x rule {icept:+.1f} mm (left {left:.1f} of {np.abs(rule[:, i]).mean():.1f} mm)")
        print(f"\ngrasp centring over {len(rule)} approach steps, the residual's shift of the command on the "
              f"center rule's: " + "; ".join(fits))
    if shifted:
        fixed = sum(k > 0 for k in shifted)
        print(f"grasp offsets (xy grid of 25 within ±{cfg.offset * 100:.1f} cm, until the lift): {fixed} of "
              f"{len(shifted)} never-lifted episodes succeed with at least one; {np.mean(shifted) / 25:.0%} of the "
              f"offsets succeed on average")
    print(f"[failures] {cfg.checkpoint}: success {counts.get('success', 0) / n:.0%} of {n} "
          f"(release: {cfg.release}" + (f", corrections: {cfg.correct}" if corrections else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
