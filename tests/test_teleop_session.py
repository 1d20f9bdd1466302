"""``robopolicy teleop`` end to end on the simulated arm with a scripted device: episodes saved,
re-recorded, discarded and marked through the device's events, loaded back by lerobot; a device
that disconnects stops the robot and keeps the committed episodes; bad input is a clear error."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("lerobot")
import robopolicy.data.recorder  # noqa: E402,F401  (lerobot's dataset stack: loaded once, at collection)

from hardware.teleop import ScriptedTeleop, TeleopReading  # noqa: E402
from robopolicy.config import ConfigError, build, load_yaml  # noqa: E402
from robopolicy.teleop.session import TeleopConfig, record_session  # noqa: E402


def _cfg(tmp_path, cameras=True, **kw):
    robot = load_yaml("configs/robots/sim_arm.yaml")
    robot["driver"]["kwargs"].update(cameras=cameras, image_size=32, camera_fps=15.0)
    robot["loop"]["fifo"] = False
    data = {"robot": robot, "teleop": {"type": "scripted", "rate_hz": 30.0, "adapter": {"mode": "ee_delta", "step": 0.004}},
            "dataset": str(tmp_path / "ds"), "task": "move the arm", "fps": 15, "episodes": 5, "episode_s": 20.0,
            "reset_s": 0.0, "status": False, "vcodec": "libsvtav1"}
    data.update(kw)
    return build(TeleopConfig, data, "<test>")


def _move(axis, n, events=()):
    return [{"values": {axis: 1.0}, "repeat": n}, {"values": {}, "events": list(events)}]


def test_teleop_records_episodes_with_lerobot_record_controls(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    script = (_move("delta_x", 15, ["save", "success"]) + _move("delta_z", 8, ["rerecord"])
              + _move("delta_y", 12, ["save", "failure"]) + _move("delta_x", 5, ["discard"]) + _move("delta_x", 4, ["stop"]))
    lines: list[str] = []
    result = record_session(_cfg(tmp_path, cameras=False), device=ScriptedTeleop(script), on_status=lines.append)
    assert result.fault is None and result.stopped_by == "operator (stop)"
    assert result.episodes == [0, 1] and result.rerecorded == 1 and result.discarded == 1
    ds = LeRobotDataset("robopolicy/local", root=tmp_path / "ds", video_backend="pyav")
    assert ds.meta.total_episodes == 2 and len(ds) == result.frames > 5
    ep = ds.meta.episodes
    assert list(ep["robopolicy/success"]) == [True, False]  # the operator's marks
    first = ds.hf_dataset.filter(lambda r: r["episode_index"] == 0)
    actions = np.stack([np.asarray(a) for a in first["action"]])
    assert np.abs(actions[-1] - actions[0]).max() > 0.01  # the arm was driven
    assert not any(bool(np.asarray(v).any()) for v in first["intervention"])  # a demonstration, no take-over
    assert any("episode 1 saved" in line and "marked bad" in line for line in lines)


def test_a_device_disconnect_stops_the_robot_and_keeps_committed_episodes(tmp_path):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    script = _move("delta_x", 10, ["save"]) + _move("delta_z", 40)
    device = ScriptedTeleop(script, disconnect_after=25)  # unplugged in the middle of the second episode
    lines: list[str] = []
    result = record_session(_cfg(tmp_path), device=device, on_status=lines.append)
    assert result.stopped_by == "fault" and "disconnected" in result.fault and "unplugged" in result.fault
    assert result.episodes == [0]
    ds = LeRobotDataset("robopolicy/local", root=tmp_path / "ds", video_backend="pyav")
    assert ds.meta.total_episodes == 1
    assert ds[0]["observation.images.front"].shape[-2:] == (32, 32)  # the cameras, decoded from the video
    assert any("safe stop" in line and "1 committed episode(s)" in line for line in lines)


def test_bad_input_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from robopolicy.cli import main

    monkeypatch.delenv("DISPLAY", raising=False)
    base = ["teleop", "--robot", "configs/robots/sim_arm.yaml", "--dataset", str(tmp_path / "d"), "--task", "t"]
    assert main(base + ["--teleop", "spacemouse"]) == 2
    assert "unknown teleop device 'spacemouse'" in capsys.readouterr().err
    assert main(base + ["--teleop", "keyboard"]) == 2
    assert "needs a display" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--task"):
        record_session(_cfg(tmp_path, task=""), device=ScriptedTeleop([{"values": {}}]))


class _AfterPolicyStarts(ScriptedTeleop):
    """Plays its script once the policy's first chunk has arrived (its worker loads torch first)."""

    source = None

    def read(self, observation=None):
        if self.source is None or not self.source.proposed.chunks:
            return TeleopReading({}, "delta", set())
        return super().read(observation)


def test_interventions_over_a_running_policy_are_recorded_with_its_proposal(tmp_path, monkeypatch):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from robopolicy.teleop import session

    built = session.build_session

    def keep_source(cfg, device=None):
        driver, node, source = built(cfg, device)
        device.source = source
        return driver, node, source

    monkeypatch.setattr(session, "build_session", keep_source)

    # the policy (a scripted sine in its own worker process) drives; the operator holds the arm still
    # (zero deltas) during a take-over, then gives control back and saves
    script = [{"values": {}, "repeat": 30}, {"values": {}, "events": ["toggle"]}, {"values": {}, "repeat": 20},
              {"values": {}, "events": ["toggle"]}, {"values": {}, "repeat": 10}, {"values": {}, "events": ["save"]},
              {"values": {}, "events": ["stop"]}]
    cfg = _cfg(tmp_path, cameras=False, policy="sine:amp=0.3,freq=1.0")
    result = record_session(cfg, device=_AfterPolicyStarts(script), on_status=lambda line: None)
    assert result.fault is None and result.episodes == [0] and result.interventions == 1
    ds = LeRobotDataset("robopolicy/local", root=tmp_path / "ds", video_backend="pyav")
    rows = ds.hf_dataset
    flags = np.array([bool(np.asarray(v).any()) for v in rows["intervention"]])
    assert flags.any() and not flags[0] and not flags[-1]
    action = np.stack([np.asarray(a) for a in rows["action"]])
    proposal = np.stack([np.asarray(a) for a in rows["policy.action"]])
    # while the operator holds, the policy's own plan (a sine) is recorded beside what ran
    assert np.ptp(proposal[flags], axis=0).max() > 0.05
    assert np.abs(action[flags] - proposal[flags]).max() > 0.05


def test_a_full_disk_stops_the_robot_and_keeps_the_committed_episodes(tmp_path, monkeypatch):
    import errno

    from robopolicy.data.recorder import EpisodeRecorder

    saved = EpisodeRecorder.save_episode
    calls = {"n": 0}

    def fill_disk_on_second(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return saved(self, *a, **kw)

    monkeypatch.setattr(EpisodeRecorder, "save_episode", fill_disk_on_second)
    script = _move("delta_x", 6, ["save"]) + _move("delta_y", 6, ["save"]) + _move("delta_x", 30)
    lines: list[str] = []
    result = record_session(_cfg(tmp_path, cameras=False), device=ScriptedTeleop(script), on_status=lines.append)
    assert result.stopped_by == "recording error" and "No space left" in result.fault
    assert result.episodes == [0]
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    assert LeRobotDataset("robopolicy/local", root=tmp_path / "ds", video_backend="pyav").meta.total_episodes == 1
    assert any("safe stop" in line and "1 committed episode(s)" in line for line in lines)
