import json

import pytest

from robopolicy.cli import main
from robopolicy.utils.video import read_mp4


def test_sim_list(capsys):
    assert main(["sim", "list"]) == 0
    out = capsys.readouterr().out.split()
    assert "robopolicy/PersonFollow-v0" in out and "robopolicy/ArmPickPlace-v0" in out


@pytest.mark.parametrize("env_id, extra", [
    ("robopolicy/PersonFollow-v0", ["--split", "dt"]),
    ("robopolicy/ArmReach-v0", []),
])
def test_sim_view_writes_video_and_metrics(tmp_path, capsys, env_id, extra):
    video = tmp_path / "view.mp4"
    assert main(["sim", "view", env_id, *extra, "--seed", "1", "--video", str(video)]) == 0
    out = capsys.readouterr().out
    assert "metrics:" in out and "seed 1" in out
    frames = read_mp4(video)
    assert frames.shape[0] >= 2
    # egocentric / camera views and the top-down view side by side: wider than tall
    assert frames.shape[2] > frames.shape[1]


def test_sim_demo_table(tmp_path, capsys):
    rc = main(["sim", "demo", f"out={tmp_path}", "tasks=[{id: robopolicy/ArmReach-v0}]"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "sim demo: " in out and "ArmReach-v0" in out
    rows = json.loads((tmp_path / "metrics.json").read_text())
    assert rows[0]["task"] == "ArmReach-v0"
    assert (tmp_path / "ArmReach-v0.mp4").exists()


def test_bad_inputs_are_clear_errors(capsys):
    assert main(["sim", "view", "robopolicy/Nope-v0", "video=null"]) == 2
    assert "unknown env id 'robopolicy/Nope-v0'" in capsys.readouterr().err
    assert main(["sim", "view", "robopolicy/PersonFollow-v0", "--split", "xx", "video=null"]) == 2
    assert "split" in capsys.readouterr().err
    assert main(["sim", "view", "robopolicy/ArmReach-v0", "sed=3"]) == 2
    assert "unknown key 'sed'" in capsys.readouterr().err
