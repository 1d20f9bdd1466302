"""Training-sample throughput: our cached loader vs ``LeRobotDataset.__getitem__`` (pyav).

    python bench/data_loading.py                      # generates a synthetic dataset first
    python bench/data_loading.py --dataset DIR [--samples 500] [--strides 0,1,4,16] [--horizon 16]
    python bench/data_loading.py --oracle robopolicy/PersonFollow-v0 --episodes 4

Both loaders get the same random sample indices, the same temporal context (frames at t - s for
each stride, LeRobot through ``delta_timestamps``) and the same action chunk, in one run. Each
runs in its own process so its peak RSS is its own; the cache build (first use) is timed
separately and is not part of our loader's rate. frames/s counts decoded camera frames
(samples x context x cameras).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MUJOCO_GL", "egl")


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: per address space, unlike ru_maxrss, which a child
    inherits from its parent across fork + exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def make_synthetic(root: Path, episodes: int, length: int, size: int, cameras: int, vcodec: str, fps: int) -> None:
    """Moving shapes over a gradient, state/action tracking them; ``episodes`` x ``length`` frames."""
    import numpy as np
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    names = ["front", "wrist"][:cameras]
    features = {f"observation.images.{n}": {"dtype": "video", "shape": (size, size, 3),
                                            "names": ["height", "width", "channels"]} for n in names}
    features["observation.state"] = {"dtype": "float32", "shape": (6,), "names": None}
    features["action"] = {"dtype": "float32", "shape": (6,), "names": None}
    ds = LeRobotDataset.create(repo_id="bench/synthetic", fps=fps, features=features, root=root,
                               use_videos=True, vcodec=vcodec)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size]
    for ep in range(episodes):
        pos = rng.uniform(0.2, 0.8, 2) * size
        vel = rng.normal(0, 1.5, 2)
        for i in range(length):
            pos = np.clip(pos + vel, 8, size - 8)
            frame = {}
            for c, n in enumerate(names):
                img = np.empty((size, size, 3), np.uint8)
                img[..., 0] = (xx * 255 // size).astype(np.uint8)
                img[..., 1] = (yy * 255 // size).astype(np.uint8)
                img[..., 2] = 60 * c + 40
                mask = (xx - pos[0]) ** 2 + (yy - pos[1]) ** 2 < (6 + 2 * c) ** 2
                img[mask] = (255, 40, 40)
                frame[f"observation.images.{n}"] = img
            state = np.concatenate([pos / size, vel, [np.sin(i / 10), np.cos(i / 10)]]).astype(np.float32)
            frame["observation.state"] = state
            frame["action"] = (state + rng.normal(0, 0.01, 6)).astype(np.float32)
            frame["task"] = "follow the red ball"
            ds.add_frame(frame)
        ds.save_episode()
    ds.finalize()


def make_oracle(root: Path, env_id: str, episodes: int, size: int, vcodec: str) -> None:
    from robopolicy.data.collect import CollectConfig, collect
    from robopolicy.envs import EnvConfig

    collect(CollectConfig(env=EnvConfig(id=env_id), episodes=episodes, workers=1, out=str(root),
                          image_size=size, vcodec=vcodec, progress=False), log=lambda s: None)


# ----------------------------------------------------------------------------- worker processes


def run_build(args) -> dict:
    from robopolicy.data.cache import ensure_cache

    t0 = time.perf_counter()
    entry = ensure_cache(args.dataset, args.cache_dir, progress=False)
    return {"seconds": time.perf_counter() - t0, "entry": str(entry), "peak_rss_mb": peak_rss_mb()}


def run_ours(args, strides, indices) -> dict:
    from robopolicy.data.loader import TrainingDataset

    ds = TrainingDataset(args.dataset, context_strides=strides, horizon=args.horizon, cache_dir=args.cache_dir,
                         progress=False)
    cams = len(ds.cameras)
    for i in indices[: args.warmup]:
        ds[i]
    t0 = time.perf_counter()
    for i in indices:
        ds[i]
    dt = time.perf_counter() - t0
    return {"samples_per_s": len(indices) / dt, "cameras": cams, "peak_rss_mb": peak_rss_mb()}


def run_lerobot(args, strides, indices) -> dict:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset, LeRobotDatasetMetadata

    meta = LeRobotDatasetMetadata("bench/dataset", root=args.dataset)
    fps = meta.fps
    context = [-s / fps for s in strides]
    delta = {key: context for key in meta.camera_keys}
    delta["observation.state"] = context
    delta["action"] = [k / fps for k in range(args.horizon)]
    ds = LeRobotDataset("bench/dataset", root=args.dataset, delta_timestamps=delta, video_backend="pyav")
    for i in indices[: args.warmup]:
        ds[i]
    t0 = time.perf_counter()
    for i in indices:
        ds[i]
    dt = time.perf_counter() - t0
    return {"samples_per_s": len(indices) / dt, "cameras": len(meta.camera_keys), "peak_rss_mb": peak_rss_mb()}


def run_baseline(args) -> dict:
    import torch  # noqa: F401  (both loaders pay for it)

    return {"peak_rss_mb": peak_rss_mb()}


def child(args, role: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", role, "--dataset", str(args.dataset), "--cache-dir",
           str(args.cache_dir), "--samples", str(args.samples), "--seed", str(args.seed), "--strides", args.strides,
           "--horizon", str(args.horizon), "--warmup", str(args.warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr[-4000:])
        raise SystemExit(f"{role} worker failed (exit {out.returncode})")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", type=Path, help="LeRobot v3 dataset dir (default: generate one)")
    parser.add_argument("--cache-dir", type=Path, help="training cache dir (default: a temp dir, built fresh)")
    parser.add_argument("--oracle", metavar="ENV_ID", help="generate with the env's oracle instead of synthetic")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--length", type=int, default=150, help="frames per synthetic episode")
    parser.add_argument("--image-size", type=int, default=96)
    parser.add_argument("--cameras", type=int, default=1, choices=(1, 2), help="synthetic cameras")
    parser.add_argument("--vcodec", default="libsvtav1", help="codec of the generated dataset (lerobot's default)")
    parser.add_argument("--fps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--strides", default="0,1,4,16")
    parser.add_argument("--horizon", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=("build", "ours", "lerobot", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help="also write the run record OUT/summary.json")
    args = parser.parse_args()
    started = time.time()
    strides = [int(s) for s in args.strides.split(",")]

    if args.worker:
        import numpy as np

        from robopolicy.data.cache import read_dataset

        n = read_dataset(args.dataset).num_frames
        indices = [int(i) for i in np.random.default_rng(args.seed).integers(0, n, args.samples + args.warmup)]
        indices = indices[args.warmup:] + indices[: args.warmup]  # warmup on the last few
        runs = {"build": lambda: run_build(args), "baseline": lambda: run_baseline(args), "ours": lambda: run_ours(args, strides, indices[:args.samples]),
                "lerobot": lambda: run_lerobot(args, strides, indices[:args.samples])}
        print(json.dumps(runs[args.worker]()))
        return 0

    tmp = tempfile.TemporaryDirectory(prefix="bench_data_loading_")
    if args.cache_dir is None:
        args.cache_dir = Path(tmp.name) / "cache"
    if args.dataset is None:
        args.dataset = Path(tmp.name) / "dataset"
        t0 = time.perf_counter()
        if args.oracle:
            make_oracle(args.dataset, args.oracle, args.episodes, args.image_size, args.vcodec)
        else:
            make_synthetic(args.dataset, args.episodes, args.length, args.image_size, args.cameras, args.vcodec,
                           args.fps)
        print(f"generated {args.dataset} in {time.perf_counter() - t0:.1f}s")

    from robopolicy.data.cache import read_dataset

    src = read_dataset(args.dataset)
    sizes = {k: src.features[k]["shape"] for k in src.camera_keys}
    print(f"dataset: {src.num_frames} frames, {len(src.episodes)} episodes, fps {src.fps}, cameras {sizes}")
    print(f"sample: context strides {strides}, horizon {args.horizon}; {args.samples} random samples "
          f"(seed {args.seed}), {args.warmup} warm-up samples not timed")

    build = child(args, "build")
    print(f"cache build: {build['seconds']:.2f}s ({src.num_frames * len(src.camera_keys) / build['seconds']:.0f} "
          f"frames/s), peak RSS {build['peak_rss_mb']:.0f} MB -> {build['entry']}")
    ours = child(args, "ours")
    ref = child(args, "lerobot")
    frames = len(strides) * ours["cameras"]
    print()
    print(f"| loader                         | samples/s | frames/s | peak RSS MB |")
    print(f"|--------------------------------|-----------|----------|-------------|")
    for name, r in (("robopolicy TrainingDataset", ours), ("LeRobotDataset (pyav)", ref)):
        print(f"| {name:<30} | {r['samples_per_s']:>9.1f} | {r['samples_per_s'] * frames:>8.0f} | "
              f"{r['peak_rss_mb']:>11.0f} |")
    base = child(args, "baseline")
    print(f"(peak RSS of a process that only imports torch: {base['peak_rss_mb']:.0f} MB)")
    ratio = ours["samples_per_s"] / ref["samples_per_s"]
    print(f"\nratio (ours / LeRobotDataset): {ratio:.1f}x  (goal >= 20x)")
    if args.out:
        from robopolicy.utils.records import write_summary

        write_summary(args.out, kind="bench", config=vars(args), seeds=[args.seed], started_at=started,
                      metrics={"ours": ours, "lerobot": ref, "cache_build": build, "import_torch_only": base,
                               "ratio_samples_per_s": ratio}, extra={"bench": "data_loading"})
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
