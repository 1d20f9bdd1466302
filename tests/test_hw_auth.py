"""Issue 55, the policy link: authentication at connection time (no unauthenticated buffering),
one session per peer, refused handshakes seen and logged, no replay."""

from __future__ import annotations

import logging
import os
import socket
import stat
import subprocess
import sys
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from hardware.control import ActionScheduler, ControlNode, NodeConfig, PolicyWorkerSource, SafetyFilter
from hardware.transport import Message, PolicyClient, PolicyServer
from robopolicy.deploy.worker import HoldPolicy, SinePolicy, serve
from test_hw_doubles import PointDriver, wait_for

KEY = b"k" * 32


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _obs(seq, state, t=None):
    return Message("obs", seq, time.monotonic() if t is None else t,
                   {"observation.state": np.full(6, state, np.float32)})


def _ask(client, msg, timeout=5.0):
    """Send and wait for the reply to ``msg`` (chunk or error)."""
    client.send(msg)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        client.sock.poll(50)
        for m in client.poll():
            if m.seq == msg.seq:
                return m
    return None


class _Serving:
    """serve() in a thread; closing stops it, then closes the server."""

    def __init__(self, server, policy, **kw):
        self.server, self.stop = server, threading.Event()
        self.thread = threading.Thread(target=serve, args=(server, policy), kwargs={"stop": self.stop, **kw}, daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.thread.join(5)
        self.server.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


# -- item 1: nothing unauthenticated is buffered ------------------------------------------------
@pytest.mark.parametrize("encrypt", [False, True], ids=["plain_handshake", "curve"])
def test_a_keyless_peer_cannot_grow_a_keyed_worker(tmp_path, encrypt):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    ep = f"tcp://127.0.0.1:{_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", ep, "--policy", "hold",
                             "--auth-key-file", str(key_file)] + (["--encrypt"] if encrypt else []),
                            stderr=subprocess.PIPE, text=True)
    client = PolicyClient(ep, KEY, encrypt=encrypt or None)
    ctx = zmq.Context()
    try:
        assert _ask(client, _obs(1, 0.0), timeout=60) is not None
        idle = _rss_mib(proc.pid)
        header = msgpack.packb({"v": 1, "kind": "obs", "seq": 1, "t": 0.0, "meta": {},
                                "arrays": [[f"a{i}", "uint8", [8 << 20]] for i in range(64)]})
        frame = bytes(8 << 20)
        for _ in range(3):  # the attack: [header] + [8 MiB] x 64, three times
            attacker = ctx.socket(zmq.DEALER)
            attacker.setsockopt(zmq.LINGER, 0)
            attacker.connect(ep)
            attacker.send_multipart([header] + [frame] * 64, copy=False)
            time.sleep(0.7)
            attacker.close(0)
        peak = _rss_mib(proc.pid)
        assert peak - idle <= 50, f"worker grew from {idle:.0f} to {peak:.0f} MiB"
        assert _ask(client, _obs(2, 0.0)) is not None  # and it still serves its node
    finally:
        client.close()
        ctx.term()
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "refused a connection" in err  # item 5: the refusal is logged


def test_ipc_socket_file_is_owner_only(tmp_path):
    server = PolicyServer(f"ipc://{tmp_path}/w.sock")
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "w.sock").st_mode) == 0o600
    finally:
        server.close()


# -- item 2: policy state per peer, a second peer refused or isolated ----------------------------
@pytest.mark.parametrize("keyed", [True, False])
def test_a_second_peer_cannot_reset_or_steer_the_session(tmp_path, caplog, keyed):
    ep = f"tcp://127.0.0.1:{_port()}" if keyed else f"ipc://{tmp_path}/w.sock"
    key = KEY if keyed else None
    server = PolicyServer(ep, key)
    serving = _Serving(server, SinePolicy(amp=0.2))
    node, other = PolicyClient(ep, key), PolicyClient(ep, key)
    try:
        with caplog.at_level(logging.WARNING):
            first = _ask(node, _obs(1, 0.0))
            assert first.kind == "chunk" and np.abs(first.arrays["action"]).max() < 0.5
            other.send(Message("reset", 0, time.monotonic()))
            refused = _ask(other, _obs(1, 1.5))
            refused_nan = _ask(other, _obs(2, np.nan))
            assert refused.kind == "error" and refused.meta.get("refused") is True and refused_nan.kind == "error"
            after = _ask(node, _obs(2, 0.0))
        assert after.kind == "chunk" and np.all(np.isfinite(after.arrays["action"]))
        assert np.abs(after.arrays["action"]).max() < 0.5, "the other peer's reset moved the node's plan"
        assert any("refused peer" in r.getMessage() for r in caplog.records)
    finally:
        node.close()
        other.close()
        serving.close()


def test_sessions_are_isolated_when_the_worker_serves_several(tmp_path):
    ep = f"ipc://{tmp_path}/w.sock"
    server = PolicyServer(ep)
    serving = _Serving(server, SinePolicy(amp=0.2), max_sessions=2)
    a, b = PolicyClient(ep), PolicyClient(ep)
    try:
        assert np.abs(_ask(a, _obs(1, 0.0)).arrays["action"]).max() < 0.5
        b.send(Message("reset", 0, time.monotonic()))
        assert np.abs(_ask(b, _obs(1, 1.5)).arrays["action"] - 1.5).max() < 0.5  # b's own context
        assert np.abs(_ask(a, _obs(2, 0.0)).arrays["action"]).max() < 0.5  # a's untouched
    finally:
        a.close()
        b.close()
        serving.close()


# -- item 5: a wrong key fails fast and is logged --------------------------------------------------
@pytest.mark.parametrize("encrypt", [None, True], ids=["plain_handshake", "curve"])
@pytest.mark.parametrize("node_key", [b"w" * 32, None], ids=["wrong_key", "no_key"])
def test_a_wrong_key_faults_the_node_fast_and_the_worker_logs_it(caplog, node_key, encrypt):
    ep = f"tcp://127.0.0.1:{_port()}"
    server = PolicyServer(ep, KEY, log_every=60.0, encrypt=encrypt)
    serving = _Serving(server, HoldPolicy())
    drv = PointDriver(dim=6)
    src = PolicyWorkerSource(ep, None, node_key, insecure_loopback=True, encrypt=encrypt)
    node = ControlNode(drv, src, ActionScheduler("latest"), SafetyFilter(drv.spec, 1 / drv.spec.rate_hz),
                       NodeConfig(fifo=False))  # startup_timeout stays 120 s
    try:
        with caplog.at_level(logging.WARNING, logger="robopolicy.transport"):
            t0 = time.monotonic()
            node.start()
            assert wait_for(lambda: node.fault is not None, timeout=10)
            took = time.monotonic() - t0
            time.sleep(0.5)  # more refused attempts: reconnects continue
        assert node.fault.code == "auth_refused" and "auth key" in node.fault.reason, node.fault
        assert took < 5.0 and drv.stops
        lines = [r for r in caplog.records if "refused a connection" in r.getMessage()]
        assert len(lines) >= 1 and (len(lines) < server.handshakes_refused or server.handshakes_refused == 1)
    finally:
        node.close()
        serving.close()


# -- item 6: replay ------------------------------------------------------------------------------
class _Counting(HoldPolicy):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def predict(self, obs, t):
        self.calls += 1
        return super().predict(obs, t)


def _recording_proxy(listen_port: int, target_port: int, captured: list[bytes]):
    """A man in the middle: forwards one TCP connection and records what the client sent."""
    lsock = socket.create_server(("127.0.0.1", listen_port))

    def pump(src, dst, record):
        try:
            while data := src.recv(1 << 16):
                if record:
                    captured.append(data)
                dst.sendall(data)
        except OSError:
            pass

    def run():
        conn, _ = lsock.accept()
        up = socket.create_connection(("127.0.0.1", target_port))
        threading.Thread(target=pump, args=(up, conn, False), daemon=True).start()
        pump(conn, up, True)
        up.close()  # the node hung up: so does its connection to the worker

    threading.Thread(target=run, daemon=True).start()
    return lsock


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain_handshake", "curve"])
def test_a_captured_message_replayed_without_the_key_is_refused(encrypt):
    """CURVE: the replayed handshake fails. The local PLAIN handshake can replay (capturing
    loopback traffic takes root, or a node pointed at the attacker's port), but its observations
    are not newer than that identity's last ones: dropped (tests below)."""
    port, proxy_port = _port(), _port()
    server = PolicyServer(f"tcp://127.0.0.1:{port}", KEY, encrypt=encrypt or None)
    policy = _Counting()
    serving = _Serving(server, policy)
    captured: list[bytes] = []
    lsock = _recording_proxy(proxy_port, port, captured)
    client = PolicyClient(f"tcp://127.0.0.1:{proxy_port}", KEY, encrypt=encrypt or None)
    try:
        for seq in (1, 2, 3):
            assert _ask(client, _obs(seq, 0.0)).kind == "chunk"
        client.close()
        assert policy.calls == 3 and captured
        for _ in range(2):  # the attacker resends everything the node sent, byte for byte, paced
            with socket.create_connection(("127.0.0.1", port), timeout=0.05) as s:  # as it was sent
                for chunk in captured:
                    try:
                        s.sendall(chunk)
                        time.sleep(0.02)
                        s.recv(1 << 16)
                    except OSError:  # refused: the worker hung up, or had nothing to say
                        pass
                time.sleep(0.3)
        assert policy.calls == 3, "a replayed observation reached the policy"
    finally:
        lsock.close()
        serving.close()


def test_repeated_or_stale_observations_of_a_peer_are_dropped(tmp_path):
    server = PolicyServer(f"ipc://{tmp_path}/w.sock", freshness=1.0)
    client = PolicyClient(f"ipc://{tmp_path}/w.sock")
    try:
        now = time.monotonic()
        client.send(_obs(5, 0.0, now))
        assert wait_for(lambda: server.recv_latest(50) != [] or False, timeout=2)
        for msg in (_obs(5, 0.0, now), _obs(4, 0.0, now), _obs(6, 0.0, now - 30.0)):
            client.send(msg)
        time.sleep(0.2)
        assert server.recv_latest(100) == []
        assert server.rejected["replayed"] == 2 and server.rejected["stale"] == 1
        client.send(_obs(7, 0.0))
        assert wait_for(lambda: [m.seq for _, m in server.recv_latest(50)] == [7], timeout=2)
    finally:
        client.close()
        server.close()
