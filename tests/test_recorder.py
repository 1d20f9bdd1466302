"""EpisodeRecorder: LeRobot v3.0 output, late frames, atomic commits under kill -9, bad input."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from robopolicy.data import features as F  # noqa: E402
from robopolicy.data import recorder as R  # noqa: E402

FPS = 10
SIZE = 32


def make_features() -> dict:
    import gymnasium as gym

    obs = gym.spaces.Dict({
        "observation.images.front": gym.spaces.Box(0, 255, (SIZE, SIZE, 3), np.uint8),
        "observation.state": gym.spaces.Box(-1, 1, (3,), np.float32),
    })
    act = gym.spaces.Box(-1, 1, (2,), np.float32)
    return F.dataset_features(obs, act, {F.ORACLE_WAYPOINTS: (8, 3), F.TARGET_BOX: (4,), F.TARGET_VISIBLE: (1,)})


def frame(features: dict, episode: int, i: int) -> dict:
    """A frame whose values encode (episode, frame) so damage is detectable."""
    out = {}
    for key, ft in features.items():
        if key in F.TIMING_KEYS:
            continue
        if ft["dtype"] == "video":
            out[key] = np.full(ft["shape"], (40 * episode + 5 * i) % 250, np.uint8)
        elif ft["dtype"] == "bool":
            out[key] = np.array([i % 2 == 0 and key != F.DONE])
        else:
            out[key] = np.full(ft["shape"], 1000 * episode + i, dtype=ft["dtype"])
    return out


def record(rec: R.EpisodeRecorder, features: dict, episode: int, n: int = 12, late: dict | None = None):
    rec.start_episode(seed=episode)
    for i in range(n):
        wall = i / FPS + (late or {}).get(i, 0.0)
        rec.add_frame(frame(features, episode, i), task=f"task {episode % 2}", wall_time=wall)
    return rec.save_episode()


def load_lerobot(root: Path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    return LeRobotDataset(R.REPO_ID, root=root, video_backend="pyav")


def check_episode(ds, episode: int, n: int = 12) -> None:
    ep = ds.meta.episodes[episode]
    start = ep["dataset_from_index"]
    assert ep["length"] == n
    for i in (0, n - 1):
        item = ds[start + i]
        assert int(item["episode_index"]) == episode
        assert int(item["frame_index"]) == i
        assert float(item["observation.state"][0]) == 1000 * episode + i
        expected = ((40 * episode + 5 * i) % 250) / 255.0
        assert abs(float(item["observation.images.front"].mean()) - expected) < 4 / 255.0


def test_recorder_writes_lerobot_v3_with_late_frames(tmp_path):
    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    s0 = record(rec, features, 0)
    s1 = record(rec, features, 1, late={3: 0.3, 4: 0.3})  # two frames 300 ms behind their slots
    rec.close()
    assert (s0.episode_index, s1.episode_index) == (0, 1)
    assert s0.cadence.late_frames == 0 and s1.cadence.late_frames == 2
    assert s1.cadence.max_lateness_s == pytest.approx(0.3, abs=1e-6)

    ds = load_lerobot(root)
    assert ds.meta.info["codebase_version"] == "v3.0"
    assert ds.meta.total_episodes == 2 and len(ds) == 24
    check_episode(ds, 0)
    check_episode(ds, 1)
    late_item = ds[12 + 3]
    assert bool(late_item[F.LATE]) and float(late_item[F.WALL_TIME]) == pytest.approx(0.6)
    # the slot timestamp stays on the grid so lerobot finds the video frame
    assert float(late_item["timestamp"]) == pytest.approx(0.3)
    assert bool(ds[11][F.DONE]) and not bool(ds[10][F.DONE])
    assert ds.meta.tasks.index.tolist() == ["task 0", "task 1"]
    ep_rows = R.read_episodes(root).to_pylist()
    assert [r[F.EPISODE_SEED] for r in ep_rows] == [0, 1]
    assert [r[F.EPISODE_LATE_FRAMES] for r in ep_rows] == [0, 2]
    stats = json.loads((root / "meta/stats.json").read_text())
    assert stats["index"]["max"] == [23] and stats["observation.state"]["max"][0] == 1011


def test_a_commit_reads_the_last_episode_files_only(tmp_path, monkeypatch):
    # committing episode N must not read every earlier episode's metadata (that made collecting
    # N episodes cost O(N^2) reads: 300 short episodes took minutes)
    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    for ep in range(4):
        record(rec, features, ep, n=3)
    reads = []
    real = R.read_parquet
    monkeypatch.setattr(R, "read_parquet", lambda path, what: (reads.append(what), real(path, what))[1])
    record(rec, features, 4, n=3)
    rec.close()
    assert reads.count("episode metadata") <= 1
    ds = load_lerobot(root)
    assert ds.meta.total_episodes == 5 and len(ds) == 15
    ep = ds.meta.episodes[4]
    assert ep["dataset_from_index"] == 12 and int(ds[14]["episode_index"]) == 4
    assert len({(r["data/chunk_index"], r["data/file_index"]) for r in R.read_episodes(root).to_pylist()}) == 5


def test_resume_requires_flag_and_matching_features(tmp_path):
    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    record(rec, features, 0)
    with pytest.raises(R.DatasetError, match="resume"):
        R.EpisodeRecorder(root, features, fps=FPS)
    bad = dict(features)
    bad["observation.state"] = F.vector(5)
    with pytest.raises(R.DatasetError, match="observation.state"):
        R.EpisodeRecorder(root, bad, fps=FPS, resume=True)
    rec2 = R.EpisodeRecorder(root, features, fps=FPS, resume=True)
    assert record(rec2, features, 1).episode_index == 1


def test_wrong_shape_frame_is_rejected_and_nothing_written(tmp_path):
    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    record(rec, features, 0)
    before = sorted(p.relative_to(root) for p in root.rglob("*") if ".staging" not in p.parts)
    rec.start_episode()
    bad = frame(features, 1, 0)
    bad["observation.state"] = np.zeros(7, np.float32)
    with pytest.raises(ValueError, match="observation.state.*shape"):
        rec.add_frame(bad, task="x")
    bad = frame(features, 1, 0)
    bad["observation.images.front"] = np.zeros((SIZE, SIZE + 1, 3), np.uint8)
    with pytest.raises(ValueError, match="observation.images.front"):
        rec.add_frame(bad, task="x")
    rec.close()
    after = sorted(p.relative_to(root) for p in root.rglob("*") if ".staging" not in p.parts)
    assert before == after
    assert len(load_lerobot(root)) == 12


def test_disk_full_during_commit_leaves_dataset_intact(tmp_path, monkeypatch):
    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    record(rec, features, 0)
    info_before = (root / "meta/info.json").read_bytes()
    real = R.pq.write_table

    def full_disk(table, where, **kw):
        if "data" in str(where):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(table, where, **kw)

    monkeypatch.setattr(R.pq, "write_table", full_disk)
    with pytest.raises(R.DatasetError, match=r"data/chunk-000/file-001\.parquet.*disk full"):
        record(rec, features, 1)
    monkeypatch.setattr(R.pq, "write_table", real)
    assert (root / "meta/info.json").read_bytes() == info_before
    assert not [p for p in root.rglob(".*") if ".tmp" in p.name]  # no temporary of an atomic write left
    ds = load_lerobot(root)
    assert len(ds) == 12
    check_episode(ds, 0)
    rec2 = R.EpisodeRecorder(root, features, fps=FPS, resume=True)
    assert record(rec2, features, 1).episode_index == 1
    check_episode(load_lerobot(root), 1)


def test_corrupt_info_json_is_named(tmp_path):
    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    record(rec, features, 0)
    (root / "meta/info.json").write_text("{ not json")
    with pytest.raises(R.DatasetError, match=r"meta/info\.json: corrupt JSON"):
        R.EpisodeRecorder(root, resume=True)
    (root / "meta/info.json").unlink()
    with pytest.raises(R.DatasetError, match=r"meta/info\.json: missing"):
        R.read_info(root)


# ---------------------------------------------------------------------------------------------
# kill -9
# ---------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, time, numpy as np
    sys.path.insert(0, {tests!r})
    import test_recorder as T
    from robopolicy.data import recorder as R

    root, mode = sys.argv[1], sys.argv[2]
    features = T.make_features()
    rec = R.EpisodeRecorder(root, features, fps=T.FPS, resume=True) if R.Path(root, "meta/info.json").exists() \\
        else R.EpisodeRecorder(root, features, fps=T.FPS)
    committing = [None]
    if mode.startswith("commit:"):
        step = mode.split(":", 1)[1]
        def hook(name):
            if name == step and committing[0] == 2:
                print("MID-COMMIT", flush=True)
                time.sleep(60)
        R._commit_step = hook
    for ep in range(rec.num_episodes, 10):
        rec.start_episode(seed=ep)
        for i in range(12):
            rec.add_frame(T.frame(features, ep, i), task=f"task {{ep % 2}}", wall_time=i / T.FPS)
            if ep == 2:
                print(f"FRAME {{ep}} {{i}}", flush=True)
                time.sleep(0.05)
        if mode == "episode" and ep == 2:
            time.sleep(60)
        committing[0] = ep
        rec.save_episode()
        print(f"COMMITTED {{ep}}", flush=True)
    """
)


def run_and_kill(root: Path, mode: str, marker: str) -> list[str]:
    script = CHILD.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", script, str(root), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    lines = []
    deadline = time.time() + 150
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.strip() == marker:
                break
            assert time.time() < deadline, f"child never reached {marker}: {lines[-5:]}"
        else:
            pytest.fail(f"child exited before {marker}: {lines[-5:]}")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return lines


COMMIT_STEPS = ("staged", "meta_built", "videos", "data", "exchanged", "cleaned")


def check_committed_view(ds, committed: int) -> None:
    """What lerobot shows is exactly ``committed`` whole episodes: totals, episode rows, length,
    tasks, stats and every episode's first and last frame."""
    assert ds.meta.total_episodes == committed and ds.num_episodes == committed
    assert len(ds.meta.episodes) == committed, f"{len(ds.meta.episodes)} episode rows for {committed} episodes"
    assert len(ds) == 12 * committed and ds.meta.total_frames == 12 * committed
    # no frame of an uncommitted episode: lerobot loads every file under data/, and its
    # __getitem__ does not bounds-check, so an extra row would be ds[len(ds)]
    assert len(ds.hf_dataset) == ds.meta.total_frames
    assert {int(e) for e in ds.hf_dataset["episode_index"]} == set(range(committed))
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds.meta.stats["index"]["count"][0] == 12 * committed
    assert sorted(ds.meta.tasks.index) == sorted({f"task {ep % 2}" for ep in range(committed)})
    for ep in range(committed):
        check_episode(ds, ep)


@pytest.mark.parametrize("mode,marker", [("episode", "FRAME 2 11")] + [(f"commit:{s}", "MID-COMMIT") for s in COMMIT_STEPS])
def test_kill_9_loses_only_the_episode_in_flight(tmp_path, mode, marker):
    """Killed while recording episode 2, or after any step of its commit: a reader (lerobot's
    LeRobotDataset) sees 2 whole episodes before the commit point and 3 after it, never a mix."""
    root = tmp_path / "ds"
    lines = run_and_kill(root, mode, marker)
    assert "COMMITTED 1" in lines and "COMMITTED 2" not in lines
    step = mode.split(":")[1] if mode.startswith("commit:") else None
    committed = 3 if step in ("exchanged", "cleaned") else 2
    gens = sorted(p.name for p in root.glob(R.GEN_PREFIX + "*"))
    if step in ("data", "exchanged"):  # episode 2's data file is written, into the new generation
        assert len(gens) == 2 and (root / gens[1] / "data/chunk-000/file-002.parquet").exists()
        assert (root / "data/chunk-000/file-002.parquet").exists() == (step == "exchanged")

    ds = load_lerobot(root)
    check_committed_view(ds, committed)
    del ds

    # resume cleans the leftovers and continues after the committed episodes
    features = make_features()
    rec = R.EpisodeRecorder(root, features, fps=FPS, resume=True)
    assert rec.recovery.episodes == committed and (rec.recovery.removed or step == "cleaned")
    assert not (root / R.STAGING_DIR).exists()
    assert [p.name for p in root.glob(R.GEN_PREFIX + "*")] == [os.readlink(root / R.GEN_LINK)]
    for ep in range(committed, 4):
        assert record(rec, features, ep).episode_index == ep
    rec.close()
    ds = load_lerobot(root)
    check_committed_view(ds, 4)
    stats = json.loads((root / "meta/stats.json").read_text())
    assert stats["observation.state"]["max"][0] == 3011 and stats["index"]["count"] == [48]


def test_a_dataset_of_the_older_layout_is_converted_and_appended_to(tmp_path):
    """A dataset with plain meta/ and data/ directories (written before generations, or by
    lerobot's own tools) opens, resumes and commits; an interrupted conversion is finished."""
    import shutil

    features = make_features()
    root = tmp_path / "ds"
    rec = R.EpisodeRecorder(root, features, fps=FPS)
    for ep in range(2):
        record(rec, features, ep)
    rec.close()
    gen = root / os.readlink(root / R.GEN_LINK)
    for name in ("meta", "data"):  # back to the older layout: real directories
        (root / name).unlink()
        shutil.copytree(gen / name, root / name)
    (root / R.GEN_LINK).unlink()
    shutil.rmtree(gen)
    check_committed_view(load_lerobot(root), 2)

    # an interrupted conversion: meta/ already a link into the first generation, data/ not yet
    with R.dataset_lock(root):
        R._ensure_generations(root)
    (root / "data").unlink()
    shutil.copytree(root / R.GEN_LINK / "data", root / "data")
    check_committed_view(load_lerobot(root), 2)

    rec = R.EpisodeRecorder(root, features, fps=FPS, resume=True)
    assert (root / "meta").is_symlink() and (root / "data").is_symlink()
    assert record(rec, features, 2).episode_index == 2
    rec.close()
    check_committed_view(load_lerobot(root), 3)
    assert [p.name for p in root.glob(R.GEN_PREFIX + "*")] == [os.readlink(root / R.GEN_LINK)]
