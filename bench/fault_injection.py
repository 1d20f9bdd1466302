"""Fault injection: every attack on the policy link and every fault of the control stack that
issue 55 lists (and the ones that already held), each with its reaction time and a verdict.

Attacks run against a real policy worker process (keyed: CURVE on tcp://127.0.0.1; unkeyed:
an owner-only ipc socket); node faults against a ControlNode driving an in-process point-mass
arm; signals against ``robopolicy run`` on the simulated arm; kill -9 against a recorder
committing an episode, the dataset loaded with lerobot's LeRobotDataset afterwards.

Reaction time: from the injection to the reaction (the fault latched and the driver stopped,
the refusal, the worker answering its node again), where there is one to time.

    .venv/bin/python bench/fault_injection.py          # about 1-2 minutes; exit status 1 on any failure
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # datasets are local; lerobot must not ask the hub

import msgpack
import numpy as np
import zmq

from hardware.control import ActionScheduler, Chunk, ControlNode, NodeConfig, PolicyWorkerSource, SafetyFilter
from hardware.drivers.base import DriverSpec
from hardware.transport import Message, PolicyClient, PolicyServer, TransportError

ROOT = Path(__file__).resolve().parents[1]
ROWS: list[tuple[str, str, bool, str]] = []  # (attack / fault, reaction, held, detail)


def row(name: str, held: bool, reaction_s: float | None = None, detail: str = "") -> None:
    ROWS.append((name, "-" if reaction_s is None else f"{reaction_s * 1e3:.1f} ms", bool(held), detail))
    print(f"  {'ok  ' if held else 'FAIL'} {name}: {detail}", flush=True)


def attempt(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - a crashed attack is a failed row, the rest still run
        row(name, False, None, f"raised {type(exc).__name__}: {exc}"[:200])
        traceback.print_exc()


def wait_for(pred, timeout=5.0, step=0.002) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def obs(seq: int, state: float) -> Message:
    return Message("obs", seq, time.monotonic(), {"observation.state": np.full(6, state, np.float32)})


def ask(client: PolicyClient, msg: Message, timeout: float = 5.0) -> Message | None:
    client.send(msg)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        client.wait(20)
        for m in client.poll():
            if m.seq == msg.seq:
                return m
    return None


# -- doubles ------------------------------------------------------------------------------------
class Arm:
    """A point-mass arm whose joints jump to the command; can raise, hang, or freeze holding the GIL."""

    def __init__(self, dim: int = 6, rate_hz: float = 500.0):
        self.spec = DriverSpec("arm", tuple(f"j{i}" for i in range(dim)), -np.ones(dim) * 2, np.ones(dim) * 2,
                               max_rate=50.0, command_timeout=0.5, rate_hz=rate_hz)
        self.q = np.zeros(dim)
        self.stops: list[float] = []
        self.write_times: list[float] = []
        self.fail = False
        self.hang = threading.Event()
        self.release = threading.Event()
        self.freeze_s = 0.0
        self.freeze_end = None
        self.max_abs = 0.0

    def connect(self):
        pass

    def disconnect(self):
        self.release.set()

    def read(self):
        if self.fail:
            raise IOError("bus timeout (injected)")
        if self.hang.is_set():
            self.release.wait(5.0)
        if self.freeze_s:
            us, self.freeze_s = int(self.freeze_s * 1e6), 0.0
            ctypes.PyDLL(None).usleep(us)  # a C call that keeps the GIL
            self.freeze_end = time.monotonic()
        return {"observation.state": self.q.copy()}

    def write(self, command):
        self.q = np.asarray(command, float).copy()
        self.max_abs = max(self.max_abs, float(np.abs(self.q).max()))
        self.write_times.append(time.monotonic())
        return self.q.copy()

    def stop(self):
        self.stops.append(time.monotonic())


class Script:
    """Chunks computed in-process from each observation; ``fn(state, t) -> (H, A)``."""

    def __init__(self, fn):
        self.fn, self.pending, self.next = fn, [], 0.0

    def start(self):
        pass

    def wants_observation(self, now):
        return now >= self.next

    def submit(self, o, t):
        self.next = t + 0.05
        self.pending.append(Chunk(np.asarray(self.fn(o["observation.state"], t), float), t, 0.05))

    def poll(self, now):
        out, self.pending = self.pending, []
        return out

    def health(self, now):
        return None

    def stats(self):
        return {}

    def close(self):
        pass


def hold(state, t):
    return np.repeat(np.asarray(state, float)[None], 20, axis=0)


def node_with(driver, source, **cfg) -> ControlNode:
    node = ControlNode(driver, source, ActionScheduler("latest"), SafetyFilter(driver.spec, 1 / driver.spec.rate_hz),
                       NodeConfig(fifo=False, **cfg))
    node.start()
    return node


# -- the policy link ----------------------------------------------------------------------------
class Worker:
    """A policy worker process (hold policy) on ``endpoint``."""

    def __init__(self, endpoint: str, key_file: str | None, policy: str = "hold", encrypt: bool = False):
        cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint, "--policy", policy]
        if key_file:
            cmd += ["--auth-key-file", key_file]
        if encrypt:
            cmd += ["--encrypt"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        self.endpoint = endpoint

    def stop(self) -> str:
        self.proc.terminate()
        try:
            return self.proc.communicate(timeout=10)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[1]


def malformed_headers() -> list[list[bytes]]:
    def head(**kw):
        h = {"v": 1, "kind": "obs", "seq": 1, "t": 0.0, "arrays": [], "meta": {}}
        h.update(kw)
        return msgpack.packb(h)

    bad = [
        [b""], [b"\xc1"], [msgpack.packb([1, 2, 3])], [msgpack.packb({"v": 1})], [head(v=2)], [head(kind="exec")],
        [head(seq=-1)], [head(seq=2**64 - 1)], [head(seq=True)], [head(t=float("nan"))], [head(t="now")],
        [head(arrays="x")], [head(arrays=[["x", "object", [1]]]), b"\x00"], [head(arrays=[["x", "uint8", [-1]]]), b""],
        [head(arrays=[["x", "uint8", [4]]]), b"\x00"], [head(arrays=[["x", "uint8", [1]]])],
        [head(arrays=[["../x", "uint8", [1]]]), b"\x00"], [head(arrays=[["x", "uint8", [1]], ["x", "uint8", [1]]]), b"a", b"b"],
        [head(arrays=[["x", "uint8", [1, 1, 1, 1, 1]]]), b"\x00"], [head(arrays=[["x", "uint8", [1 << 30]]]), b"\x00"],
        [head(meta={"k": [1, 2]})], [head(meta={"k": {"a": 1}})], [head(meta={"k": float("inf")})], [head(meta={1: 2})],
        [head(meta={f"k{i}": i for i in range(40)})], [head(extra=1)],
        [msgpack.packb({"v": 1, "kind": "obs", "seq": 1, "t": 0.0, "arrays": [], "meta": msgpack.ExtType(1, b"x")})],
        [head() + b"trailing"], [b"\x00" * 20000], [head(meta={"k": "x" * 5000})],
        [msgpack.packb({"v": 1, "kind": "obs", "seq": 1, "t": 0.0, "arrays": [], "meta": {"b": b"bytes"}})],
        [head(arrays=[["x", "float64", [3]]]), b"\x00" * 23], [head(arrays=[[1, "uint8", [1]]]), b"\x00"],
        [head(arrays=[["x", "uint8", [1.5]]]), b"\x00"], [head(arrays=[["x", "uint8"]]), b"\x00"], [head(kind=None)],
    ]
    return bad


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/robopolicy_fault_injection_pwned",))


def link_attacks(wd: str) -> None:
    """The attacks that held before (against the unkeyed owner-only ipc worker, as a local peer)."""
    ep = f"ipc://{wd}/w.sock"
    worker = Worker(ep, None)
    client = PolicyClient(ep)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(ep)
    try:
        if ask(client, obs(1, 0.0), timeout=60) is None:
            raise RuntimeError("the worker never answered")
        seq = [1]

        def serves() -> float:
            seq[0] += 1
            t0 = time.monotonic()
            reply = ask(client, obs(seq[0], 0.0))
            if reply is None or reply.kind != "chunk":
                raise RuntimeError("the worker stopped answering its node")
            return time.monotonic() - t0

        def sends(frames_list, name, detail):
            t0 = time.monotonic()
            for frames in frames_list:
                raw.send_multipart(frames)
            took = serves()
            row(name, worker.proc.poll() is None, time.monotonic() - t0, f"{detail}; the node's next round trip {took * 1e3:.1f} ms")

        sends([[pickle.dumps(_Exploit())]], "pickle payload", "dropped, never unpickled")
        if os.path.exists("/tmp/robopolicy_fault_injection_pwned"):
            row("pickle payload executed", False, None, "the exploit ran")
        sends([[os.urandom(n)] for n in (1, 7, 100, 4096)] + [[b"\x00" * 64, b"\x01"]], "garbage frames", "5 messages dropped")
        bad = malformed_headers()
        sends(bad, "malformed headers", f"{len(bad)} variants dropped")
        good = obs(1, 0.0)
        from hardware.transport import encode
        burst = [list(encode(good)) for _ in range(10_000)]
        before = rss_mib(worker.proc.pid)
        sends(burst, "burst of 10,000 messages", "")
        ROWS[-1] = ROWS[-1][:3] + (f"worker RSS {before:.0f} -> {rss_mib(worker.proc.pid):.0f} MiB, still serving",)
        # SIGKILL of the worker: the node side (tested with the node below)
    finally:
        raw.close(0)
        client.close()
        ctx.term()
        worker.stop()


def keyed_attacks(wd: str) -> None:
    keyed_attacks_on(wd, encrypt=False)  # what a local worker runs: a PLAIN handshake, then clear messages
    keyed_attacks_on(wd, encrypt=True)  # what a worker on the network runs: CURVE


def keyed_attacks_on(wd: str, encrypt: bool) -> None:
    key_file = os.path.join(wd, "key")
    Path(key_file).write_text(secrets.token_hex(32))
    key = Path(key_file).read_bytes().strip()
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    mode = "curve" if encrypt else "handshake"
    enc = True if encrypt else None
    worker = Worker(ep, key_file, policy="sine:amp=0.2", encrypt=encrypt)
    node = PolicyClient(ep, key, encrypt=enc)

    def row(name, *a, **kw):  # noqa: F811 - every row of this part names the mode
        globals()["row"](f"{name} [{mode}]", *a, **kw)

    ctx = zmq.Context()
    log = ""
    try:
        if ask(node, Message("reset", 0, time.monotonic()), timeout=0.5) is None:
            pass  # a reset has no reply; it opens the node's session
        first = ask(node, obs(1, 0.0), timeout=60)
        if first is None:
            raise RuntimeError("the keyed worker never answered")
        # 1. memory exhaustion by a keyless peer
        idle = rss_mib(worker.proc.pid)
        header = msgpack.packb({"v": 1, "kind": "obs", "seq": 1, "t": 0.0, "meta": {},
                                "arrays": [[f"a{i}", "uint8", [8 << 20]] for i in range(64)]})
        frame = bytes(8 << 20)
        t0 = time.monotonic()
        peak = idle
        for _ in range(3):
            a = ctx.socket(zmq.DEALER)
            a.setsockopt(zmq.LINGER, 0)
            a.connect(ep)
            a.send_multipart([header] + [frame] * 64, copy=False)
            for _ in range(10):
                time.sleep(0.05)
                peak = max(peak, rss_mib(worker.proc.pid))
            a.close(0)
        took = time.monotonic() - t0
        reply = ask(node, obs(2, 0.0))
        row("keyless [header] + [8 MiB] x 64, x3 (tcp lo)", peak - idle <= 50 and reply is not None, None,
            f"worker RSS {idle:.0f} -> peak {peak:.0f} MiB (+{peak - idle:.0f}, limit +50) over {took:.1f} s")
        # 2. a second peer (with the key) resets and steers
        other = PolicyClient(ep, key, encrypt=enc)
        other.send(Message("reset", 0, time.monotonic()))
        t0 = time.monotonic()
        r1 = ask(other, obs(1, 1.5))
        refusal = time.monotonic() - t0
        r2 = ask(other, obs(2, float("nan")))
        after = ask(node, obs(3, 0.0))
        steady = after is not None and after.kind == "chunk" and float(np.abs(after.arrays["action"]).max()) < 0.5
        row("second peer: reset + state 1.5", r1 is not None and r1.kind == "error" and steady, refusal,
            f"refused ({(r1.meta.get('reason') if r1 else 'no reply')}); the node's chunk max "
            f"{float(np.abs(after.arrays['action']).max()) if after else float('nan'):.2f} rad")
        row("second peer: reset + NaN state", r2 is not None and r2.kind == "error" and steady
            and bool(np.isfinite(after.arrays["action"]).all()), None, "refused; the node's chunks stay finite")
        other.close()
        # 3. replay of captured traffic, byte for byte, by someone without the key
        proxy_port = free_port()
        captured: list[bytes] = []
        lsock = socket.create_server(("127.0.0.1", proxy_port))

        def pump(src, dst, rec):
            try:
                while data := src.recv(1 << 16):
                    if rec:
                        captured.append(data)
                    dst.sendall(data)
            except OSError:
                pass

        def proxy():
            conn, _ = lsock.accept()
            up = socket.create_connection(("127.0.0.1", port))
            threading.Thread(target=pump, args=(up, conn, False), daemon=True).start()
            pump(conn, up, True)
            up.close()

        threading.Thread(target=proxy, daemon=True).start()
        via = PolicyClient(f"tcp://127.0.0.1:{proxy_port}", key, encrypt=enc)
        replies_before = [ask(via, obs(s, 0.0)) for s in (1, 2, 3)]
        via.close()
        time.sleep(0.2)
        calls_before = sum(1 for r in replies_before if r is not None)
        got = b""
        with socket.create_connection(("127.0.0.1", port), timeout=0.05) as s:
            for chunk in captured:  # paced as the node sent it
                try:
                    s.sendall(chunk)
                    time.sleep(0.02)
                    got += s.recv(1 << 16)
                except OSError:
                    pass
            time.sleep(0.3)
            try:
                got += s.recv(1 << 16)
            except OSError:
                pass
        lsock.close()
        answers = got.count(b"chunk")
        row("replay of captured traffic (no key)", calls_before == 3 and answers == 0, None,
            f"{sum(map(len, captured))} bytes replayed; chunks answered: {answers}")
        # 4. a wrong key (or none) on the node: fails fast
        for label, node_key in (("a wrong key", b"w" * 32), ("no key", None)):
            drv = Arm()
            src = PolicyWorkerSource(ep, None, node_key, insecure_loopback=True, encrypt=enc)
            t0 = time.monotonic()
            n = node_with(drv, src)
            ok = wait_for(lambda: n.fault is not None, timeout=10)
            took = time.monotonic() - t0
            code = n.fault.code if n.fault else None
            n.close()
            row(f"node with {label}", ok and code == "auth_refused" and bool(drv.stops), took,
                f"fault {code} (startup_timeout is {NodeConfig().startup_timeout:.0f} s)")
        # 5. loopback tcp without a key: refused at bind
        try:
            PolicyServer(f"tcp://127.0.0.1:{free_port()}")
            row("loopback tcp without a key", False, None, "bound")
        except TransportError:
            row("loopback tcp without a key", True, None, "refused at bind (insecure_loopback opts out)")
    finally:
        node.close()
        ctx.term()
        log = worker.stop()
    lines = [ln for ln in log.splitlines() if "refused" in ln]
    row("refusals logged by the worker, rate-limited", bool(lines) and len(lines) < 20, None, f"{len(lines)} log lines")


# -- the node -------------------------------------------------------------------------------------
def node_faults(wd: str) -> None:
    def chunk_fault(name, bad_value, code):
        calls = []

        def fn(state, t):
            calls.append(t)
            c = np.zeros((10, 6))
            if len(calls) > 3:
                c[:, 1] = bad_value
            return c

        drv = Arm()
        n = node_with(drv, Script(fn))
        try:
            ok = wait_for(lambda: n.fault is not None)
            f = n.fault
            row(name, ok and f.code == code and bool(drv.stops) and drv.max_abs < 0.5,
                f.stop_latency if f else None, f"fault {f.code if f else None}; largest joint command {drv.max_abs:.2f}")
        finally:
            n.close()

    chunk_fault("NaN chunk", np.nan, "non_finite")
    chunk_fault("command 1e6", 1e6, "out_of_range")
    chunk_fault("command -1.7e308", -1.7e308, "out_of_range")
    chunk_fault("command +1.7e308", 1.7e308, "out_of_range")

    def driver_fault(name, inject, code, timeout=None):
        drv = Arm()
        n = node_with(drv, Script(hold), **({"command_timeout": timeout} if timeout else {}))
        try:
            wait_for(lambda: len(drv.write_times) > 50)
            t0 = time.monotonic()
            inject(drv)
            ok = wait_for(lambda: n.fault is not None, timeout=5)
            f = n.fault
            stale = [t for t in drv.write_times if drv.freeze_end is not None and t >= drv.freeze_end]
            react = (drv.stops[0] - t0) if drv.stops else None
            row(name, ok and f.code == code and bool(drv.stops) and not stale, react,
                f"fault {f.code if f else None}" + (f"; commands written after the freeze: {len(stale)}"
                                                     if drv.freeze_end is not None else ""))
        finally:
            drv.release.set()
            n.close()

    driver_fault("driver raises", lambda d: setattr(d, "fail", True), "driver_error")
    driver_fault("driver hangs (releases the GIL)", lambda d: d.hang.set(), "driver_hang")
    driver_fault("driver freezes 1 s holding the GIL", lambda d: setattr(d, "freeze_s", 1.0), "command_timeout")
    driver_fault("driver freezes 0.3 s holding the GIL (timeout 0.1 s)", lambda d: setattr(d, "freeze_s", 0.3),
                 "command_timeout", timeout=0.1)

    # SIGKILL of the worker process
    ep = f"ipc://{wd}/k.sock"
    cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", ep, "--policy", "hold"]
    drv = Arm()
    src = PolicyWorkerSource(ep, cmd)
    n = ControlNode(drv, src, ActionScheduler("ensemble"), SafetyFilter(drv.spec, 1 / 500),
                    NodeConfig(fifo=False, driver_timeout=0.25))
    n.start()
    try:
        if not wait_for(lambda: src.replies >= 5, timeout=60):
            raise RuntimeError("worker never answered")
        t0 = time.monotonic()
        os.kill(src.proc.pid, signal.SIGKILL)
        ok = wait_for(lambda: n.fault is not None)
        row("SIGKILL of the worker", ok and n.fault.code == "worker_died" and bool(drv.stops),
            (drv.stops[0] - t0) if drv.stops else None, f"fault {n.fault.code if n.fault else None}")
    finally:
        n.close()


# -- robopolicy run and signals -------------------------------------------------------------------
def run_signals(wd: str) -> None:
    for sigs, code in (((signal.SIGTERM,), 143), ((signal.SIGHUP,), 129), ((signal.SIGINT, signal.SIGINT), 130)):
        name = " + ".join(s.name for s in sigs)
        report = Path(wd) / f"run_{name.replace(' + ', '_')}.json"
        cmd = [sys.executable, "-m", "robopolicy.cli", "run", "--robot", str(ROOT / "configs/robots/sim_arm.yaml"),
               "--policy", "hold", "--report", str(report), "robot.driver.kwargs.cameras=false", "robot.loop.fifo=false"]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("[run]") and " 0 ticks" not in line:
                    break
            for s in sigs:
                proc.send_signal(s)
                time.sleep(0.02)  # a second Ctrl-C 20 ms after the first
            proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        rep = json.loads(report.read_text()) if report.is_file() else {}
        sd = rep.get("shutdown", {})
        period = 1.0 / rep.get("rate_hz", 500.0)
        react = sd.get("signal_to_stop_s")
        ok = (proc.returncode == code and bool(sd.get("driver_stopped")) and bool(sd.get("driver_disconnected")))
        row(f"{name} to robopolicy run", ok, react,
            f"rc {proc.returncode}, report {'written' if rep else 'MISSING'}, driver stopped {sd.get('driver_stopped')}, "
            f"disconnected {sd.get('driver_disconnected')}; signal to stop "
            f"{'-' if react is None else f'{react / period:.1f}'} control periods")


# -- recorder -------------------------------------------------------------------------------------
COLLECT = textwrap.dedent(
    """
    import sys, time, numpy as np, gymnasium as gym
    from robopolicy.data import features as F, recorder as R
    root, step = sys.argv[1], sys.argv[2]
    obs = gym.spaces.Dict({"observation.images.front": gym.spaces.Box(0, 255, (32, 32, 3), np.uint8),
                           "observation.state": gym.spaces.Box(-1, 1, (3,), np.float32)})
    feats = F.dataset_features(obs, gym.spaces.Box(-1, 1, (2,), np.float32))
    rec = R.EpisodeRecorder(root, feats, fps=10)
    now = [0]
    def hook(name):
        if name == step and now[0] == 2:
            print("KILL-ME", flush=True); time.sleep(60)
    R._commit_step = hook
    for ep in range(3):
        now[0] = ep
        rec.start_episode(seed=ep)
        for i in range(10):
            frame = {}
            for key, ft in feats.items():
                if key in F.TIMING_KEYS:
                    continue
                dtype = np.uint8 if ft["dtype"] == "video" else ft["dtype"]
                frame[key] = np.full(ft["shape"], ep if dtype != "bool" else False, dtype)
            frame["observation.images.front"][:] = ep * 40
            rec.add_frame(frame, task="t", wall_time=i / 10)
        rec.save_episode()
        print("COMMITTED", ep, flush=True)
    """
)


def collect_kill(wd: str) -> None:
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from robopolicy.data import recorder as R

    for step in ("meta_built", "data", "exchanged"):
        root = Path(wd) / f"ds_{step}"
        proc = subprocess.Popen([sys.executable, "-c", COLLECT, str(root), step], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        reached = False
        for line in proc.stdout:
            if line.strip() == "KILL-ME":
                reached = True
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if not reached:
            raise RuntimeError(f"the recording process exited before commit step {step!r}")
        want = 3 if step == "exchanged" else 2
        ds = LeRobotDataset(R.REPO_ID, root=root, video_backend="pyav")
        rows_, total, n = len(ds.meta.episodes), ds.meta.total_episodes, len(ds)
        last = ds[n - 1]
        ok = rows_ == total == want and n == 10 * want and int(last["episode_index"]) == want - 1
        past = ds.hf_dataset.num_rows - n  # rows of a published data file no committed episode names
        row(f"kill -9 during collect (after commit step '{step}')", ok, None,
            f"lerobot sees {total} episodes, {rows_} episode rows, {n} frames (committed: {want})"
            + (f"; {past} uncommitted rows past len(ds), reachable only by an out-of-range index" if past else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("link", "keyed", "node", "run", "collect"), action="append")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    parts = {"link": link_attacks, "keyed": keyed_attacks, "node": node_faults, "run": run_signals, "collect": collect_kill}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rp-fault-") as wd:
        for name, fn in parts.items():
            if args.only and name not in args.only:
                continue
            print(f"[{name}]", flush=True)
            attempt(name, lambda: fn(wd))
    width = max(len(r[0]) for r in ROWS)
    print(f"\n| {'attack / fault':<{width}} | reaction   | verdict | detail")
    print(f"|{'-' * (width + 2)}|------------|---------|-------")
    for name, react, held, detail in ROWS:
        print(f"| {name:<{width}} | {react:>10} | {'held' if held else 'FAILED':<7} | {detail}")
    failed = [r for r in ROWS if not r[2]]
    print(f"\n{len(ROWS) - len(failed)}/{len(ROWS)} held in {time.monotonic() - t0:.0f} s; load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
