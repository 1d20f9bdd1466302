"""The deployment daemon in this process on the simulated arm, through its HTTP API (real HTTP on an
ephemeral loopback port): auth on every mutating call, health, metrics, episodes recorded as LeRobot
v3, policy hot-swap, worker crash and driver loss, and systemd's notify protocol on a fake socket."""

import json
import os
import signal
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from robopolicy.deploy.daemon import Daemon, load_deploy_config  # noqa: E402

TOKEN = "0123456789abcdef0123456789abcdef"
MUTATING = [("POST", "/estop", None), ("POST", "/faults/reset", None), ("POST", "/episodes/start", {}),
            ("POST", "/episodes/stop", {}), ("PUT", "/policy", {"checkpoint": "hold"})]


class NotifySocket:
    """A fake systemd NOTIFY_SOCKET: a datagram socket whose thread collects what the daemon sends."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[str] = []
        self.running = True
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self):
        while self.running:
            try:
                self.messages.extend(self.sock.recv(4096).decode().split("\n"))
            except (socket.timeout, BlockingIOError):
                pass

    def drain(self):
        out, self.messages = self.messages, []
        return out

    def names(self):
        return list(self.messages)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "token").write_text(TOKEN + "\n")
    notify = NotifySocket(tmp / "notify.sock")
    old = os.environ.get("NOTIFY_SOCKET")
    os.environ["NOTIFY_SOCKET"] = str(tmp / "notify.sock")
    cfg = load_deploy_config("configs/deploy/sim_arm.yaml", [
        "api.port=0", f"api.token_file={tmp / 'token'}", f"recording.root={tmp / 'episodes'}", "log_file=null",
        "robot.loop.fifo=false", "robot.driver.kwargs.image_size=48",
        "supervisor.restart_backoff_s=0.2", "supervisor.ready_timeout_s=60"])
    daemon = Daemon(cfg)
    try:
        daemon.start()
        client = httpx.Client(base_url=daemon.api.url, timeout=30.0)
        yield daemon, client, notify, tmp
    finally:
        if old is None:
            os.environ.pop("NOTIFY_SOCKET", None)
        else:
            os.environ["NOTIFY_SOCKET"] = old
        daemon.shutdown("test")
        assert daemon.node.stop_commanded
        time.sleep(0.2)
        notify.running = False
        assert "STOPPING=1" in notify.names()


def auth():
    return {"Authorization": f"Bearer {TOKEN}"}


def wait_for(predicate, timeout=10.0, period=0.01):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"not true within {timeout}s")


def test_ready_only_when_warm_and_healthy(served):
    daemon, client, notify, _ = served
    assert "READY=1" in notify.names()  # sent by start(): robot connected, policy answering
    assert client.get("/livez").json() == {"live": True}
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    s = client.get("/status").json()
    assert s["robot"] == "sim_arm" and s["node"]["fault"] is None and len(s["state"]) == 6
    assert s["node"]["ticks"] > 0 and s["cameras"] == ["front", "wrist"]
    img = client.get("/camera/front.jpg")
    assert img.status_code == 200 and img.content[:2] == b"\xff\xd8"
    assert client.get("/history", params={"seconds": 2}).json()["t"]


def test_every_mutating_call_without_the_token_is_refused(served):
    daemon, client, _, _ = served
    for method, path, body in MUTATING:
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": TOKEN}):
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
    assert daemon.node.fault is None and daemon.writer.episode is None and daemon.policy.startswith("sine")
    assert client.get("/readyz").status_code == 200


def test_fault_shows_on_readyz_and_metrics_within_100ms(served):
    daemon, client, _, _ = served
    assert client.post("/estop", headers=auth()).status_code == 200
    fault = wait_for(lambda: daemon.node.faults.active, timeout=2.0, period=0.001)
    seen = {}
    while len(seen) < 2 and time.monotonic() - fault.t < 1.0:
        if "readyz" not in seen and client.get("/readyz").status_code == 503:
            seen["readyz"] = time.monotonic() - fault.t
        if "metrics" not in seen and 'robopolicy_fault_active{code="estop"} 1.0' in client.get("/metrics").text:
            seen["metrics"] = time.monotonic() - fault.t
    assert seen.keys() == {"readyz", "metrics"} and max(seen.values()) < 0.1, seen
    assert client.get("/readyz").json()["why"].startswith("fault latched: estop")
    metrics = client.get("/metrics").text
    assert 'robopolicy_faults_total{code="estop"} 1.0' in metrics
    for name in ("robopolicy_loop_lateness_seconds_bucket", "robopolicy_loop_missed_ticks_total",
                 "robopolicy_inference_seconds_count", "robopolicy_episodes_saved_total",
                 'robopolicy_queue_depth{queue="recorder"}'):
        assert name in metrics
    r = client.post("/faults/reset", headers=auth())
    assert r.status_code == 200 and r.json()["reset"] is True
    wait_for(lambda: client.get("/readyz").status_code == 200, timeout=5.0)
    assert client.post("/faults/reset", headers=auth()).status_code == 409  # nothing latched now


def test_episode_is_recorded_as_lerobot_v3(served):
    daemon, client, _, _ = served
    r = client.post("/episodes/start", headers=auth(), json={"task": "wave"})
    assert r.status_code == 200, r.text
    assert client.post("/episodes/start", headers=auth()).status_code == 409  # one at a time
    assert client.put("/policy", headers=auth(), json={"checkpoint": "hold"}).status_code == 409  # between episodes only
    time.sleep(1.5)
    r = client.post("/episodes/stop", headers=auth(), json={"success": True})
    assert r.status_code == 200, r.text
    ep = r.json()["episode"]
    assert ep["saved"] is True and ep["frames"] >= 20, ep
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    ds = LeRobotDataset("robopolicy/local", root=ep["dataset"], video_backend="pyav")
    assert ds.meta.total_episodes >= 1 and len(ds) >= ep["frames"]
    item = ds[len(ds) - 1]
    assert tuple(item["observation.images.front"].shape) == (3, 48, 48)
    assert tuple(item["policy.chunk"].shape)[1] == 6 and item["task"] == "wave"
    assert client.get("/status").json()["recording"]["episodes_saved"] >= 1


def test_policy_hot_swap_and_bad_checkpoints_refused(served, tmp_path):
    daemon, client, _, _ = served
    bad = tmp_path / "bad_ckpt"
    bad.mkdir()
    (bad / "config.yaml").write_text("type: no-such-policy-type\n")
    for spec, words in ((str(tmp_path / "missing"), "neither a checkpoint"),
                        ("arc", "this arm takes (6,) actions"),
                        (str(bad), "could not load it")):
        r = client.put("/policy", headers=auth(), json={"checkpoint": spec})
        assert r.status_code == 409 and words in r.json()["why"], (spec, r.text)
        assert daemon.policy.startswith("sine") and client.get("/readyz").status_code == 200
    r = client.put("/policy", headers=auth(), json={"checkpoint": "sine:amp=0.1,freq=1.0"})
    assert r.status_code == 200 and r.json()["swapped"] is True, r.text
    assert client.get("/status").json()["policy"] == "sine:amp=0.1,freq=1.0"
    time.sleep(0.5)
    assert client.get("/readyz").status_code == 200 and daemon.node.fault is None


def test_worker_crash_holds_safe_restarts_and_marks_the_episode(served):
    daemon, client, _, _ = served
    assert client.post("/episodes/start", headers=auth()).status_code == 200
    time.sleep(0.5)
    old = daemon.node.source.proc
    os.kill(old.pid, signal.SIGKILL)
    fault = wait_for(lambda: daemon.node.fault, timeout=3.0)
    assert fault.code == "worker_died"
    wait_for(lambda: client.get("/readyz").status_code == 503, timeout=1.0)
    wait_for(lambda: daemon.worker_restarts >= 1 and daemon.node.source.proc is not old, timeout=5.0)
    ep = client.post("/episodes/stop", headers=auth()).json()["episode"]
    assert "worker_died" in ep["faults"] and ep["worker_restarts"] >= 1
    from robopolicy.data.recorder import read_episodes

    row = read_episodes(ep["dataset"]).to_pylist()[ep["episode_index"]]
    assert "worker_died" in row["robopolicy/faults"] and row["robopolicy/worker_restarts"] >= 1
    wait_for(lambda: client.post("/faults/reset", headers=auth()).status_code == 200, timeout=5.0)
    wait_for(lambda: client.get("/readyz").status_code == 200, timeout=10.0)


def test_watchdog_pings_follow_the_loop_not_a_timer(served):
    daemon, client, notify, _ = served
    notify.drain()
    time.sleep(1.2)
    assert "WATCHDOG=1" in notify.names()
    driver = daemon.driver
    real_read = driver.read

    def stuck_read():
        time.sleep(1.5)  # the loop thread is stuck here
        return real_read()

    driver.read = stuck_read
    try:
        wait_for(lambda: time.monotonic() - daemon.node.timer.last_start > 0.6, timeout=2.0)
        notify.drain()
        time.sleep(0.7)
        assert "WATCHDOG=1" not in notify.names()
    finally:
        del driver.read
    wait_for(lambda: "WATCHDOG=1" in notify.names(), timeout=5.0)
    wait_for(lambda: daemon.node.fault is not None or client.get("/readyz").status_code == 200, timeout=3.0)
    if daemon.node.fault is not None:  # the node's own watchdog saw the stuck call (driver_hang)
        client.post("/faults/reset", headers=auth())


def test_driver_disconnect_is_a_latched_fault_everywhere(served):
    daemon, client, _, tmp = served
    daemon.node.reset()
    os.kill(daemon.driver._sim.pid, signal.SIGKILL)
    fault = wait_for(lambda: daemon.node.fault, timeout=5.0)
    assert fault.code == "driver_error"
    # the API answers from the daemon's snapshots (every 25 ms): the timing is the test above's
    wait_for(lambda: client.get("/readyz").json()["why"].startswith("fault latched: driver_error"), timeout=1.0)
    assert client.get("/status").json()["node"]["fault"]["code"] == "driver_error"
    assert 'robopolicy_fault_active{code="driver_error"} 1.0' in client.get("/metrics").text
    time.sleep(0.3)
    assert any(e["event"] == "fault" and e["code"] == "driver_error" for e in daemon.log.recent)
    json.dumps(client.get("/status").json())
