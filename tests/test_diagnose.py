"""robopolicy diagnose: failure breakdowns of PickPlace and tracking policies, through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from robopolicy.cli import main
from robopolicy.diagnose import pickplace_failures as pp
from robopolicy.diagnose import tracking_failures as tf
from robopolicy.models.encoders import EncoderConfig
from robopolicy.models.language import LanguageConfig
from robopolicy.models.policy import Policy, PolicyConfig
from sim_envs.arm import so101


def _stats(mean: np.ndarray, std: float) -> dict:
    mean = np.asarray(mean, np.float32)
    return {"mean": mean, "std": np.full(mean.shape, std, np.float32), "min": mean - std, "max": mean + std,
            "q01": mean - std, "q99": mean + std}


def holding_arm_policy() -> Policy:
    """A state-based ArmPickPlace chunk policy that commands the middle of the joint range whatever
    it sees (a tiny action std): it never picks the cube up."""
    torch.manual_seed(0)
    cfg = PolicyConfig(head="chunk_l1", cameras=[], use_state=True, env_state_dim=33, context_strides=[0], horizon=4,
                       language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1, head_layers=1,
                       action_shape=[6], state_dim=6)
    mid = (so101.JOINT_LOW + so101.JOINT_HIGH) / 2
    stats = {"action": _stats(mid, 1e-4), "observation.state": _stats(np.zeros(6), 1.0),
             "observation.environment_state": _stats(np.zeros(33), 1.0)}
    return Policy(cfg, stats).eval()


def constant_waypoint_policy(v: float = 0.0, omega: float = 0.0) -> Policy:
    """A waypoint policy that predicts the waypoints of one twist whatever it sees (``v = 0``: all at
    the robot, it stands still)."""
    from sim_envs.person_follow.waypoints import arc_waypoints

    torch.manual_seed(0)
    cfg = PolicyConfig(head="waypoints", cameras=["front"], encoders=[EncoderConfig(name="test_resnet", image_size=32)],
                       grid=2, context_strides=[0], horizon=8, language=LanguageConfig(enabled=False), d_model=32,
                       n_heads=2, n_layers=1, head_layers=1, action_shape=[8, 3], state_dim=2, frame_size=[32, 32])
    stats = {"action": _stats(arc_waypoints(v, omega, 0.1, 8), 1e-4), "observation.state": _stats(np.zeros(2), 1e-4)}
    return Policy(cfg, stats).eval()


def test_pickplace_episode_ends_are_classified_by_the_cubes_height_and_place():
    up, down = pp.LIFTED + 0.01, so101.CUBE_HALF
    assert pp.classify(True, up, down, 0.0) == "success"
    assert pp.classify(False, down, down, 0.5) == "never lifted"
    assert pp.classify(False, up, up, 0.0) == "held over the bowl"
    assert pp.classify(False, up, up, so101.BOWL_RADIUS + 0.01) == "held elsewhere"
    assert pp.classify(False, up, down, 0.3) == "dropped or placed outside"


def test_center_correction_moves_the_commanded_tool_point_onto_the_cube_up_to_its_range():
    from sim_envs.arm.ik import ArmIK

    arm = ArmIK()
    q, reachable = arm.analytic(np.array([0.2, 0.05, 0.04]))  # the tool point low over the table
    assert reachable
    action = np.append(q, 0.5)
    cmd = arm.fk(action[:5])[0]
    scene = np.zeros(33)
    state = np.zeros(6)
    for offset, expected in ((np.array([0.008, -0.006]), np.array([0.008, -0.006])),    # within range: onto it
                             (np.array([0.03, 0.0]), np.array([0.02, 0.0]))):           # beyond: the range
        scene[3:6] = [cmd[0] + offset[0], cmd[1] + offset[1], pp.so101.CUBE_HALF]
        scene[8:11] = [0.3, 0.3, 0.0]
        fixed = pp.Corrections(["center"], limit=0.02)(action, state, scene, {"goal_cube": 0}, t=0)
        np.testing.assert_allclose(arm.fk(fixed[:5])[0][:2] - cmd[:2], expected, atol=1.5e-3)
        assert fixed[5] == action[5]  # the gripper is not the center correction's
    far = scene.copy()
    far[3:5] = cmd[:2] + 0.1  # the command is not near the cube: nothing to centre
    np.testing.assert_array_equal(pp.Corrections(["center"])(action, state, far, {"goal_cube": 0}, t=0), action)


def test_pickplace_failures_of_a_policy_that_never_lifts(tmp_path, capsys):
    ckpt = holding_arm_policy().save(tmp_path / "arm")
    out = tmp_path / "diag"
    argv = ["diagnose", "pickplace-failures", "--checkpoint", str(ckpt), "--episodes", "2", "--seed", "7",
            "--out", str(out), "--no-progress", "env_kwargs.max_steps=12", "release=step", "correct=center,narrow",
            "grasp_offsets=true", "offset=0.005"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "| never lifted | 2 | 100% |" in lines and "| success | 0 | 0% |" in lines
    assert any(line.startswith("grasp offsets (xy grid of 25 within ±0.5 cm") and "0 of 2 never-lifted" in line
               for line in lines)
    assert lines[-1] == (f"[diagnose] pickplace-failures {ckpt}: success 0% of 2 (never lifted 2, held over the bowl 0, "
                         "held elsewhere 0, dropped or placed outside 0)")
    result = json.loads((out / "pickplace-failures.json").read_text())
    assert result["counts"]["never lifted"] == 2 and result["grasp_offsets"] == [0, 0] and result["seed"] == 7
    record = json.loads((out / "summary.json").read_text())
    assert record["kind"] == "diagnose" and record["diagnosis"] == "pickplace-failures"
    assert record["seeds"] == [7] and record["episodes"] == 2
    assert record["metrics"]["success_rate"] == 0.0 and record["metrics"]["ends"]["never lifted"] == 1.0


def test_pickplace_failures_names_bad_settings(tmp_path, capsys):
    ckpt = holding_arm_policy().save(tmp_path / "arm")
    assert main(["diagnose", "pickplace-failures", "--checkpoint", str(ckpt), "correct=center,wiggle"]) == 2
    assert "wiggle" in capsys.readouterr().err
    assert main(["diagnose", "pickplace-failures", "--checkpoint", str(ckpt), "release=chunk"]) == 2
    assert "release must be none or step" in capsys.readouterr().err
    with pytest.raises(ValueError, match="checkpoint"):
        pp.diagnose(pp.PickPlaceFailuresConfig())


def tracking_rows(lines: list[str]) -> dict[str, int]:
    return {line.split("|")[1].strip(): int(line.split("|")[2]) for line in lines[2:2 + len(tf.KINDS)]}


def test_tracking_failures_of_a_policy_that_stands_still(tmp_path, capsys):
    ckpt = constant_waypoint_policy().save(tmp_path / "still")
    argv = ["diagnose", "tracking-failures", "--checkpoint", str(ckpt), "--split", "stt", "--episodes", "2",
            "--no-progress", "env_kwargs.max_steps=30"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = tracking_rows(lines)
    assert list(rows) == list(tf.KINDS) and sum(rows.values()) == 2 and rows["success"] == 0
    assert not any(kind.startswith("collision") and n for kind, n in rows.items())
    driving = next(line for line in lines if line.startswith("driving, over "))
    assert abs(float(driving.split("forward speed mean ")[1].split()[0])) < 0.01  # it never moves
    assert lines[-1] == f"[diagnose] tracking-failures {ckpt} (stt): success 0.0%, collision 0.0%, lost " \
                        f"{rows['lost'] / 2:.1%} of 2"


def test_tracking_failures_inspects_the_contacts_of_a_policy_that_drives_in_circles(tmp_path, capsys):
    ckpt = constant_waypoint_policy(v=1.0, omega=-0.6).save(tmp_path / "circles")
    argv = ["diagnose", "tracking-failures", "--checkpoint", str(ckpt), "--split", "stt", "--episodes", "2",
            "--no-progress", "env_kwargs.max_steps=150", "window=5"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert tracking_rows(lines)["collision: obstacle or wall"] == 2
    assert any(line.startswith("collisions: 2; forward speed at contact: mean 1.00 m/s") for line in lines)
    assert any(line.startswith("obstacle or wall contacts: 2") for line in lines)
    table = [line for line in lines if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(table) == 2 and all(" / 5 |" in line for line in table)
    assert lines[-1].endswith("success 0.0%, collision 100.0%, lost 0.0% of 2")


def test_tracking_failures_needs_a_waypoint_policy(tmp_path):
    ckpt = holding_arm_policy().save(tmp_path / "arm")
    with pytest.raises(ValueError, match="not a waypoint policy"):
        tf.diagnose(tf.TrackingFailuresConfig(checkpoint=str(ckpt), episodes=1), progress=False)
