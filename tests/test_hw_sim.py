"""Simulated drivers in real time, through the node and a worker process, and `robopolicy run`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from test_hw_doubles import wait_for
from robopolicy.commands import run as run_cmd
from robopolicy.deploy.run import RunConfig, build_node
from robopolicy.config import build, load_yaml


def test_hardware_layer_does_not_import_torch():
    code = ("import sys, hardware.control, hardware.drivers, hardware.transport, hardware.drivers.sim_arm, "
            "hardware.drivers.sim_base, robopolicy.deploy.worker; print('torch' in sys.modules, 'lerobot' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False False"


def _cfg(robot_yaml: str, policy: str, tmp_path, **robot_over) -> RunConfig:
    data = {"robot": load_yaml(robot_yaml), "policy": policy, "report": str(tmp_path / "t.json")}
    for k, v in robot_over.items():
        data["robot"].setdefault(k, {}).update(v)
    return build(RunConfig, data, robot_yaml)


def test_sim_arm_follows_the_worker(tmp_path):
    cfg = _cfg("configs/robots/sim_arm.yaml", "sine:amp=0.3,freq=1.0", tmp_path)
    driver, node = build_node(cfg, str(tmp_path))
    driver.connect()
    try:
        start = driver.read()["observation.state"].copy()
        assert "observation.images.front" in driver.read() and driver.read()["observation.images.front"].shape == (96, 96, 3)
        assert driver.read()["task"] == driver.instruction != "" and set(driver.task_info()) == {"is_success", "task_distance"}
        node.start()
        assert wait_for(lambda: node.scheduler.received >= 10, timeout=60), (node.fault, node.source.stats())
        assert wait_for(lambda: np.abs(driver.read()["observation.state"][:5] - start[:5]).max() > 0.05)
        assert node.fault is None, node.fault
        t = time.monotonic()
        node.estop("test")
        assert wait_for(lambda: node.fault is not None)
        assert node.fault.stop_latency < 0.1, time.monotonic() - t
        held = driver.read()["observation.state"].copy()
        time.sleep(0.3)
        assert np.abs(driver.read()["observation.state"][:5] - held[:5]).max() < 0.05  # holds its position
    finally:
        node.close()
        driver.disconnect()


def test_sim_base_follows_waypoints_and_stops(tmp_path):
    cfg = _cfg("configs/robots/sim_base.yaml", "arc:v=0.4,omega=0.2", tmp_path)
    driver, node = build_node(cfg, str(tmp_path))
    driver.connect()
    try:
        node.start()
        assert wait_for(lambda: driver.read()["observation.state"][0] > 0.2, timeout=30)  # measured forward speed
        node.estop("test")
        assert wait_for(lambda: np.allclose(driver.read()["observation.state"], 0.0), timeout=2)
    finally:
        node.close()
        driver.disconnect()


def test_run_command_writes_a_timing_report(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    run_cmd.add_parser(parser.add_subparsers())
    report = tmp_path / "run.json"
    args = parser.parse_args(["run", "--robot", "configs/robots/sim_arm.yaml", "--policy", "hold", "--duration", "4",
                              "--report", str(report), "robot.driver.kwargs.cameras=false"])
    assert args.func(args) == 0
    data = json.loads(report.read_text())
    assert data["timing"]["ticks"] > 100 and data["faults"] == []
    assert data["source"]["replies"] > 0 and "p99" in data["timing"]["lateness_us"]
    out = capsys.readouterr().out
    assert "[run]" in out and "p99 late" in out and "timing report" in out


def test_sim_base_reports_finished_episodes():
    from hardware.drivers.sim_base import SimBaseDriver

    driver = SimBaseDriver(env_kwargs={"split": "stt", "max_steps": 3}, cameras=False)
    driver.connect()
    try:
        assert driver.instruction and driver.read()["task"] == driver.instruction
        assert wait_for(lambda: len(driver.task_info()["episodes"]) >= 3, timeout=10)
        info = driver.task_info()
        assert set(info) >= {"target_distance", "target_visible", "is_success", "episodes"}
        assert not set(info) & {"task", "episodes_done", "recent_episodes"}
        ep = info["episodes"][0]
        assert 1 <= ep["steps"] <= 3 and isinstance(ep["tracking_rate"], float) and ep["instruction"]
    finally:
        driver.disconnect()

    driver = SimBaseDriver(env_kwargs={"split": "stt", "max_steps": 2}, cameras=False, auto_reset=False)
    driver.connect()
    try:
        driver.write(np.array([0.5, 0.0]))
        assert wait_for(lambda: driver.task_info().get("episode_done", False), timeout=5)
        assert wait_for(lambda: np.allclose(driver.read()["observation.state"], 0.0), timeout=2)  # stands still
        time.sleep(0.3)
        assert len(driver.episodes) == 1 and driver.task_info() == {"episode_done": True, "episodes": driver.episodes}
    finally:
        driver.disconnect()
