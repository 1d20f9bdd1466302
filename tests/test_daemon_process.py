"""``robopolicy serve`` as a process: a bad config refused before anything moves, SIGTERM (safe
stop, the episode flushed, exit 0), kill -9 (the next start recovers the dataset)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from robopolicy.config import ConfigError  # noqa: E402
from robopolicy.deploy.daemon import load_deploy_config  # noqa: E402

TOKEN = "fedcba9876543210fedcba9876543210"
CONFIG = "configs/deploy/sim_arm.yaml"


@pytest.mark.parametrize("overrides, words", [
    (["api.host=0.0.0.0"], "api.host: 0.0.0.0 is not a loopback address"),
    (["api.token_file=/no/such/token"], "api.token_file"),
    (["robot.driver.type=warp_drive"], "robot.driver.type: unknown driver"),
    (["policy=no_such_policy"], "policy:"),
    (["robot.transport.spawn_worker=false"], "robot.transport.spawn_worker"),
    (["recording.vcodec=divx"], "recording.vcodec"),
    (["recording.root=/proc/1/nope/episodes"], "recording.root"),
    (["api.port=70000"], "api.port"),
])
def test_bad_config_is_refused_naming_the_key(overrides, words):
    with pytest.raises(ConfigError, match=None) as err:
        load_deploy_config(CONFIG, overrides)
    assert words in str(err.value) and CONFIG in str(err.value)


def test_bad_config_exits_2_before_anything_moves(monkeypatch, tmp_path):
    import hardware.drivers

    def no_driver(*a, **k):
        raise AssertionError("a driver was built for a refused config")

    monkeypatch.setattr(hardware.drivers, "make_driver", no_driver)
    short = tmp_path / "token"
    short.write_text("short")
    from robopolicy.cli import main

    assert main(["serve", "--config", CONFIG, f"api.token_file={short}"]) == 2
    assert main(["serve", "--config", CONFIG, "api.host=192.168.1.10"]) == 2
    assert main(["serve", "--config", CONFIG, "--check"]) == 0


def _start(tmp: Path, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "robopolicy.cli", "serve", "--config", CONFIG, "api.port=0",
           f"api.token_file={tmp / 'token'}", f"recording.root={tmp / 'episodes'}", f"log_file={log}",
           "robot.loop.fifo=false", "robot.driver.kwargs.image_size=32", "robot.driver.kwargs.cameras=false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, MUJOCO_GL="egl"))
    end = time.monotonic() + 60
    port = None
    while time.monotonic() < end and proc.poll() is None:
        events = _events(log)
        port = next((e["port"] for e in events if e["event"] == "api_listening"), port)
        if any(e["event"] == "ready" for e in events):
            return proc, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"daemon not ready: {_events(log)[-5:]}")


def _events(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def test_sigterm_flushes_the_episode_and_exits_0(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    proc, url = _start(tmp_path, tmp_path / "run.jsonl")
    try:
        assert httpx.post(f"{url}/episodes/start", headers=headers).status_code == 200
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = _events(tmp_path / "run.jsonl")
    saved = [e for e in events if e["event"] == "episode_saved"]
    stopped = [e for e in events if e["event"] == "stopped"]
    assert len(saved) == 1 and saved[0]["frames"] >= 5, events[-5:]
    assert stopped and stopped[0]["reason"] == "SIGTERM" and stopped[0]["driver_stopped"] is True
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("robopolicy/local", root=saved[0]["dataset"], video_backend="pyav")
    assert ds.meta.total_episodes == 1 and len(ds) == saved[0]["frames"]


def test_kill9_mid_episode_is_recovered_by_the_next_start(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from robopolicy.deploy.daemon import EpisodeWriter, EventLog

    (tmp_path / "token").write_text(TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    proc, url = _start(tmp_path, tmp_path / "run.jsonl")
    try:
        assert httpx.post(f"{url}/episodes/start", headers=headers).status_code == 200
        time.sleep(0.6)
        first = httpx.post(f"{url}/episodes/stop", headers=headers, timeout=60).json()["episode"]
        assert first["saved"] is True
        dataset = Path(first["dataset"])
        assert httpx.post(f"{url}/episodes/start", headers=headers).status_code == 200
        end = time.monotonic() + 10
        while time.monotonic() < end and not any((dataset / ".staging").glob("*")):
            time.sleep(0.05)
        assert any((dataset / ".staging").glob("*")), "the second episode never reached the disk"
    finally:
        proc.kill()
        proc.wait(10)
    # what the next start does first, before the robot moves: recover every segment
    cfg = load_deploy_config(CONFIG, [f"recording.root={tmp_path / 'episodes'}"])
    log = EventLog(str(tmp_path / "next.jsonl"))
    writer = EpisodeWriter(cfg.recording, log, "sim_arm")
    writer.open()
    writer.close()
    events = _events(tmp_path / "next.jsonl")
    assert any(e["event"] == "dataset_recovered" and e["path"] == str(dataset) for e in events), events
    assert not (dataset / ".staging").exists()
    ds = LeRobotDataset("robopolicy/local", root=dataset, video_backend="pyav")
    assert ds.meta.total_episodes == 1 and len(ds) == first["frames"]
