"""``robopolicy run --teleop DEVICE --dataset DIR``: interventions over a running policy through the
run command (the teleop session's machinery): frames carry ``intervention`` and the policy's
proposal; bad flag combinations are clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("lerobot")
import robopolicy.data.recorder  # noqa: E402,F401  (lerobot's dataset stack: loaded once, at collection)

from hardware.teleop import TeleopReading  # noqa: E402
from robopolicy.cli import main  # noqa: E402


def _device_yaml(tmp_path, script):
    (tmp_path / "script.json").write_text(json.dumps(script))
    path = tmp_path / "device.yaml"
    path.write_text(f"type: scripted\nkwargs: {{script: {tmp_path / 'script.json'}}}\nrate_hz: 30.0\n"
                    "adapter: {mode: ee_delta, step: 0.004}\n")
    return str(path)


def test_run_with_teleop_records_interventions_over_the_policy(tmp_path, monkeypatch, capsys):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from robopolicy.teleop import session

    built = session.build_session

    def script_after_the_policy_starts(cfg, device=None):
        driver, node, source = built(cfg, device)
        read = source.device.read

        def gated(observation=None):  # the policy's worker loads torch first: play once it proposes
            return read(observation) if source.proposed.chunks else TeleopReading({}, "delta", set())

        source.device.read = gated
        return driver, node, source

    monkeypatch.setattr(session, "build_session", script_after_the_policy_starts)
    script = [{"values": {}, "repeat": 30}, {"values": {}, "events": ["toggle"]}, {"values": {}, "repeat": 20},
              {"values": {}, "events": ["toggle"]}, {"values": {}, "repeat": 10}, {"values": {}, "events": ["save"]},
              {"values": {}, "events": ["stop"]}]
    code = main(["run", "--robot", "configs/robots/sim_arm.yaml", "--policy", "sine:amp=0.3,freq=1.0",
                 "--teleop", _device_yaml(tmp_path, script), "--dataset", str(tmp_path / "ds"), "--task", "move the arm",
                 "robot.loop.fifo=false", "robot.driver.kwargs.cameras=false", "status=false", "fps=15"])
    assert code == 0
    assert "run: 1 intervention(s)" in capsys.readouterr().out
    ds = LeRobotDataset("robopolicy/local", root=tmp_path / "ds", video_backend="pyav")
    assert ds.meta.total_episodes == 1
    rows = ds.hf_dataset
    flags = np.array([bool(np.asarray(v).any()) for v in rows["intervention"]])
    assert flags.any() and not flags[0] and not flags[-1]
    action = np.stack([np.asarray(a) for a in rows["action"]])
    proposal = np.stack([np.asarray(a) for a in rows["policy.action"]])
    assert np.abs(action[flags] - proposal[flags]).max() > 0.05  # the operator held still, the policy's sine went on


def test_run_teleop_flags_are_checked(tmp_path, capsys):
    base = ["run", "--robot", "configs/robots/sim_arm.yaml"]
    assert main(base + ["--teleop", "scripted", "--policy", "hold"]) == 2
    assert "--dataset DIR" in capsys.readouterr().err
    assert main(base + ["--teleop", "scripted", "--dataset", str(tmp_path / "d")]) == 2
    assert "--checkpoint DIR" in capsys.readouterr().err
    assert main(base + ["--policy", "hold", "--dataset", str(tmp_path / "d")]) == 2
    assert "--dataset goes with --teleop" in capsys.readouterr().err
    assert main(base + ["--teleop", "spacemouse", "--policy", "hold", "--dataset", str(tmp_path / "d"), "--task", "t"]) == 2
    assert "unknown teleop device 'spacemouse'" in capsys.readouterr().err
