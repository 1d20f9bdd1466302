"""The fleet learner under a simulated fleet: 100 robots (threads) each send a synthetic episode
every ``--period`` seconds (jittered) to one :class:`~robopolicy.scale.fleet_learner.FleetLearner`,
which trains back to back. Anchor: the same learner training alone (ingest off).

    python bench/fleet_ingest.py                       # 100 robots, one 100-frame episode each per 5 s, 3 repeats
    python bench/fleet_ingest.py --camera 64           # with a 64x64 camera (video encoded at commit)

Prints, as the median of the repeats: episodes/min ingested with the dataset commits (every
episode appended to a LeRobot dataset through EpisodeRecorder) and with labels only (no dataset),
the training rate (fine-tuning steps/s) with ingest off and on, and their ratio; writes
``summary.json`` under ``--out``. An episode is what a robot of ``robopolicy fleet`` sends:
state, action, the policy's proposal, the oracle's label and ``intervention`` on every frame
(half of them intervened), as numpy columns.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_policy(state_dim: int, action_dim: int):
    import torch

    from robopolicy.models.policy import LanguageConfig, Policy, PolicyConfig

    torch.manual_seed(0)
    cfg = PolicyConfig(head="chunk_l1", cameras=[], context_strides=[0], horizon=10,
                       language=LanguageConfig(enabled=False), d_model=64, n_heads=4, n_layers=2, head_layers=2,
                       action_shape=[action_dim], state_dim=state_dim)
    stats = {"action": {k: np.full(action_dim, v, np.float32) for k, v in
                        (("mean", 0), ("std", 0.5), ("min", -1), ("max", 1), ("q01", -1), ("q99", 1))},
             "observation.state": {k: np.full(state_dim, v, np.float32) for k, v in
                                   (("mean", 0), ("std", 1), ("min", -3), ("max", 3), ("q01", -3), ("q99", 3))}}
    return Policy(cfg, stats).eval()


def synthetic_episode(rng: np.random.Generator, robot: int, seed: int, frames: int, state_dim: int, action_dim: int,
                      camera: int) -> dict:
    """One robot episode of ``frames`` steps, the second half under intervention."""
    from robopolicy.data import features as F

    action = rng.uniform(-1, 1, (frames, action_dim)).astype(np.float32)
    obs = {F.STATE: rng.normal(size=(frames, state_dim)).astype(np.float32)}
    if camera:
        obs[F.IMAGE_PREFIX + "front"] = rng.integers(0, 255, (frames, camera, camera, 3), dtype=np.uint8)
    return {"actor": robot, "seed": seed, "version": 0, "eval": False, "success": bool(seed % 2), "task": "", "fps": 10,
            "obs": obs, F.ACTION: action, "policy.action": action[::-1].copy(), F.ORACLE_ACTION: action,
            F.INTERVENTION: np.arange(frames) >= frames // 2, "flags": np.zeros((frames, 0), bool),
            F.REWARD: np.zeros(frames, np.float32), F.SUCCESS: np.zeros(frames, bool),
            "wall": np.arange(frames) / 10.0}


def hg_settings(finetune_steps: int):
    from robopolicy.teleop.hg_dagger import HGDAggerConfig

    return HGDAggerConfig(finetune_steps=finetune_steps, batch_size=32, lr=1e-4, device="cpu", max_states=50_000,
                          progress=False)


def one_repeat(args, dataset: bool, root: Path) -> dict:
    """Train alone for ``seconds``, then with the robots sending for ``seconds``: the two rates."""
    from robopolicy.scale.fleet_learner import FleetLearner

    rng = np.random.default_rng(0)
    policy = make_policy(args.state_dim, args.action_dim)
    learner = FleetLearner(policy, hg_settings(args.finetune_steps), root / "weights", root / "ds" if dataset else None,
                           retrain_every=0, queue_size=args.queue, log=lambda m: None, vcodec=args.vcodec)
    warm = synthetic_episode(rng, 0, 0, args.frames, args.state_dim, args.action_dim, args.camera)
    learner.start()
    learner.add_labels([warm])
    deadline = time.monotonic() + 300
    while learner.train_steps < 5 and time.monotonic() < deadline:  # the training process has started; not timed
        time.sleep(0.1)
    s0, t0 = learner.train_steps, time.perf_counter()
    time.sleep(args.seconds)
    alone = (learner.train_steps - s0) / (time.perf_counter() - t0)

    templates = [synthetic_episode(rng, r, r, args.frames, args.state_dim, args.action_dim, args.camera)
                 for r in range(min(args.robots, 8))]
    stop = threading.Event()

    def robot(r: int) -> None:  # one episode every `period` seconds (+-50 %), from a random start
        n, wait = 0, np.random.default_rng(r)
        if stop.wait(wait.uniform(0, args.period)):
            return
        while not stop.is_set():
            learner.submit({**templates[r % len(templates)], "actor": r, "seed": 1_000_000 * r + n})
            n += 1
            stop.wait(args.period * wait.uniform(0.5, 1.5))

    robots = [threading.Thread(target=robot, args=(r,), daemon=True) for r in range(args.robots)]
    for t in robots:
        t.start()
    time.sleep(args.period)  # every robot is sending
    e0, s0, t0 = learner.stats.episodes, learner.train_steps, time.perf_counter()
    time.sleep(args.seconds)
    dt = time.perf_counter() - t0
    ingested, with_ingest = (learner.stats.episodes - e0) / dt * 60, (learner.train_steps - s0) / dt
    stop.set()
    while any(t.is_alive() for t in robots) or not learner.intake.empty():  # what is still queued is not timed
        try:
            learner.intake.get_nowait()
        except queue.Empty:
            time.sleep(0.01)
    learner.close()
    wait = learner.stats.queue_wait_s
    return {"episodes_per_min": ingested, "train_steps_per_s_alone": alone, "train_steps_per_s_ingest": with_ingest,
            "ratio": with_ingest / alone if alone else float("nan"),
            "commit_ms_median": 1000 * statistics.median(learner.stats.commit_s) if learner.stats.commit_s else None,
            "queue_wait_ms_median": 1000 * statistics.median(wait) if wait else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--robots", type=int, default=100)
    p.add_argument("--period", type=float, default=5.0,
                   help="seconds between one robot's episodes (100 robots at 5 s: 1,200 episodes/min offered)")
    p.add_argument("--frames", type=int, default=100, help="frames per episode")
    p.add_argument("--state-dim", type=int, default=20)
    p.add_argument("--action-dim", type=int, default=7)
    p.add_argument("--camera", type=int, default=0, help="image size of one camera per frame (0: none)")
    p.add_argument("--seconds", type=float, default=20.0, help="timed seconds per phase")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--finetune-steps", type=int, default=20, help="training steps between publishes")
    p.add_argument("--queue", type=int, default=64)
    p.add_argument("--vcodec", default="libsvtav1")
    p.add_argument("--modes", default="dataset,labels", help="dataset: commit every episode; labels: no dataset")
    p.add_argument("--out", default="outputs/bench/fleet_ingest")
    args = p.parse_args(argv)

    import torch

    from robopolicy.data.collect import quiet_encoders
    from robopolicy.utils.records import write_summary

    torch.set_num_threads(1)
    quiet_encoders()
    started = time.time()
    metrics: dict = {"robots": args.robots, "offered_per_min": args.robots / args.period * 60, "frames": args.frames, "camera": args.camera, "repeats": args.repeats,
                     "load_average_start": os.getloadavg()[0]}
    for mode in args.modes.split(","):
        runs = []
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                runs.append(one_repeat(args, mode == "dataset", Path(tmp)))
            print(f"{mode} repeat {r}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[-1].items() if v is not None),
                  flush=True)
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0] if runs[0][k] is not None}
        metrics[mode] = {**{k: round(v, 3) for k, v in med.items()}, "runs": runs}
        print(f"{mode}: {med['episodes_per_min']:.0f} episodes/min ingested of {metrics['offered_per_min']:.0f} offered "
              f"by {args.robots} robots (goal >= 1000); "
              f"training {med['train_steps_per_s_alone']:.2f} steps/s alone, {med['train_steps_per_s_ingest']:.2f} "
              f"with ingest: ratio {med['ratio']:.2f}x (median of {args.repeats})")
    metrics["load_average_end"] = os.getloadavg()[0]
    write_summary(args.out, kind="bench", config=vars(args), episodes=None, metrics=metrics, started_at=started)
    print(f"load average {metrics['load_average_start']:.1f} -> {metrics['load_average_end']:.1f}; "
          f"{Path(args.out) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
