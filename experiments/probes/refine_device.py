"""One DAgger refinement run per device, side by side: where its wall clock goes, and what a GPU buys.

    .venv/bin/python experiments/probes/refine_device.py base=outputs/train/arm_state_75/final \\
        config=configs/refine/dagger/pickplace_state.yaml "overrides=[iterations=3]"
    .venv/bin/python experiments/probes/refine_device.py base=CKPT "devices=[cpu]" threads=2   # the CPU row alone

Runs ``robopolicy refine --method dagger`` with the same config, seed and overrides once per device
in ``devices`` (default: ``cpu``, then ``cuda`` when there is one), and prints per run the wall
clock of the rollouts (env workers and the oracle's labels, always on the CPU), of fine-tuning (on
the device), and of the evaluations, the fine-tuning steps per second, and the success after, then
the ratio of each phase to the first device's (the anchor). Each run writes its checkpoint and
summary under ``out/<device>``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from robopolicy.config import load_config  # noqa: E402


@dataclass
class DeviceBenchConfig:
    base: str = ""
    """Policy checkpoint to refine."""
    config: str = "configs/refine/dagger/pickplace_state.yaml"
    """DAgger config."""
    overrides: list[str] = field(default_factory=list)
    """``key=value`` overrides of the DAgger config, the same for every device."""
    devices: list[str] = field(default_factory=list)
    """Devices in order (the first is the anchor); empty: ``cpu``, and ``cuda`` when available."""
    threads: int = 0
    """Torch threads of each run (0: the config's)."""
    out: str = "outputs/probes/refine_device"


def main(argv: list[str]) -> int:
    from robopolicy.refine import dagger

    cfg = load_config(DeviceBenchConfig, None, argv)
    if not cfg.base:
        raise SystemExit("give base=CHECKPOINT")
    devices = cfg.devices or ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    rows = []
    for device in devices:
        extra = [f"threads={cfg.threads}"] if cfg.threads > 0 else []
        run = load_config(dagger.DAggerConfig, cfg.config,
                          [f"base={cfg.base}", *cfg.overrides, *extra, f"device={device}",
                           f"out={cfg.out}/{device.replace(':', '')}"])
        name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else f"{os.cpu_count()} cores"
        print(f"[device] {device} ({name}): {run.iterations} iterations x {run.steps_per_iteration} states, "
              f"{run.finetune_steps} fine-tuning steps each, threads {run.threads}", flush=True)
        t0 = time.perf_counter()
        summary = dagger.train(run, log=lambda m: print(m, flush=True))
        phases = summary["seconds_by_phase"]
        rows.append({"device": device, "name": name, "total": time.perf_counter() - t0, **phases,
                     "finetune_sps": run.iterations * run.finetune_steps / max(phases["finetune"], 1e-9),
                     "before": summary["before"], "after": summary["after"]})
        r = rows[-1]
        print(f"[device] {device}: {r['total']:.0f} s (rollouts {r['rollout']:.0f}, fine-tuning {r['finetune']:.1f} at "
              f"{r['finetune_sps']:.1f} steps/s, evaluations {r['eval']:.0f}), success {r['before']:.1%} → "
              f"{r['after']:.1%}", flush=True)
    anchor = rows[0]
    print("\n| device | total s | rollouts s | fine-tuning s | fine-tuning steps/s | evaluations s | success before → after |"
          "\n|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['device']} ({r['name']}) | {r['total']:.0f} | {r['rollout']:.0f} | {r['finetune']:.1f} | "
              f"{r['finetune_sps']:.1f} | {r['eval']:.0f} | {r['before']:.1%} → {r['after']:.1%} |")
    for r in rows[1:]:
        print(f"[device] {r['device']} vs {anchor['device']}: fine-tuning {anchor['finetune'] / r['finetune']:.2f}x "
              f"faster, whole run {anchor['total'] / r['total']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
