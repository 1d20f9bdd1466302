"""Observation → chunk round trip: our ZeroMQ + msgpack transport vs a gRPC unary call.

Request: a 96×96×3 uint8 frame plus a 6-float state (and the task string); reply: a (20, 6)
float32 chunk. Ours: the real policy worker process (``hold`` policy) behind a PolicyServer,
validated on both ends, over ipc (local default) and tcp://127.0.0.1, with a shared key: the
local handshake (the key checked once per connection, as a worker on the robot's own computer
runs) and CURVE (every message encrypted, as a worker across a network runs); ``--no-key``: the
unauthenticated link (ipc, and loopback tcp opted out). gRPC: a server process
with a generic handler and raw-bytes (de)serializers carrying the same bytes as our frames, and
answering with pre-built reply bytes of our reply's size (no parsing: favours gRPC).

The transports take turns in blocks of ``--block`` round trips, so that the load of a shared
machine falls on all of them alike.

    python bench/transport.py --n 2000
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from typing import Any

import numpy as np

from hardware.transport import Message, PolicyClient, encode


def _request() -> Message:
    rng = np.random.default_rng(0)
    return Message("obs", 1, time.monotonic(), {
        "observation.state": rng.standard_normal(6).astype(np.float32),
        "observation.images.front": rng.integers(0, 255, (96, 96, 3), dtype=np.uint8),
    }, {"task": "reach the red target"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_grpc(port: int, reply_bytes: int) -> None:
    import grpc

    reply = bytes(reply_bytes)
    handler = grpc.method_handlers_generic_handler("bench.Policy", {
        "Infer": grpc.unary_unary_rpc_method_handler(lambda req, ctx: reply),  # bytes in, bytes out
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


class Ours:
    """The real policy worker process (``hold``) behind a PolicyServer, and a PolicyClient."""

    def __init__(self, endpoint: str, key_file: str | None, encrypt: bool = False):
        cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint, "--policy", "hold"]
        cmd += ["--auth-key-file", key_file] if key_file else ["--insecure-loopback"]
        cmd += ["--encrypt"] if encrypt else []
        self.proc = subprocess.Popen(cmd)
        key = open(key_file, "rb").read().strip() if key_file else None
        self.client = PolicyClient(endpoint, key, insecure_loopback=key is None, encrypt=encrypt or None)
        self.msg = _request()
        self.seq = 0

    def trip(self) -> float:
        self.seq += 1
        self.msg.seq, self.msg.t = self.seq, time.monotonic()
        t0 = time.perf_counter()
        self.client.send(self.msg)
        if not self.client.wait(30_000):
            raise RuntimeError("no reply from the worker")
        reply = self.client.poll()
        dt = time.perf_counter() - t0
        assert reply and reply[0].kind == "chunk" and reply[0].arrays["action"].shape == (20, 6)
        return dt

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait()


class Grpc:
    """A gRPC server process answering raw bytes, and a unary call."""

    def __init__(self, request: bytes, reply_bytes: int):
        import grpc

        port = _free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-grpc", str(port), "--reply-bytes", str(reply_bytes)])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.call = self.channel.unary_unary("/bench.Policy/Infer", request_serializer=None, response_deserializer=None)
        self.request, self.reply_bytes = request, reply_bytes

    def trip(self) -> float:
        t0 = time.perf_counter()
        out = self.call(self.request)
        dt = time.perf_counter() - t0
        assert len(out) == self.reply_bytes
        return dt

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait()


def interleaved(links: dict[str, Any], n: int, warmup: int, block: int) -> dict[str, np.ndarray]:
    """Round trips in blocks of ``block``, the transports taking turns (in a rotating order),
    so that a change of the machine's load during the run falls on all of them alike."""
    for link in links.values():
        for _ in range(warmup):
            link.trip()
    times: dict[str, list[float]] = {name: [] for name in links}
    names = list(links)
    for b in range((n + block - 1) // block):
        for name in names[b % len(names):] + names[:b % len(names)]:
            times[name] += [links[name].trip() for _ in range(min(block, n - len(times[name])))]
    return {name: np.array(t) * 1e6 for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--block", type=int, default=50, help="round trips per turn of each transport")
    p.add_argument("--no-key", action="store_true", help="measure the unauthenticated link instead")
    p.add_argument("--serve-grpc", type=int, help=argparse.SUPPRESS)
    p.add_argument("--reply-bytes", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_grpc:
        serve_grpc(args.serve_grpc, args.reply_bytes)
        return
    req_frames = encode(_request())
    request = b"".join(bytes(f) for f in req_frames)
    reply_frames = encode(Message("chunk", 1, 0.0, {"action": np.zeros((20, 6), np.float32)}, {"dt": 0.05, "infer_ms": 0.1}))
    reply_bytes = sum(len(bytes(f)) for f in reply_frames)
    load = os.getloadavg()
    print(f"round trip of {len(request)} request bytes / {reply_bytes} reply bytes, n={args.n}, interleaved in "
          f"blocks of {args.block}; {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{'no key' if args.no_key else 'keyed'}")
    links: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rp-tr-") as wd:
        key_file = None
        if not args.no_key:
            key_file = os.path.join(wd, "key")
            with open(key_file, "w") as f:
                f.write(secrets.token_hex(32))
        tag = "" if args.no_key else " +key"
        try:
            links[f"ours zmq ipc{tag}"] = Ours(f"ipc://{wd}/b.sock", key_file)
            links[f"ours zmq tcp lo{tag}"] = Ours(f"tcp://127.0.0.1:{_free_port()}", key_file)
            if key_file:  # what a worker across a network runs: every message encrypted
                links["ours tcp lo +key CURVE"] = Ours(f"tcp://127.0.0.1:{_free_port()}", key_file, encrypt=True)
            links["gRPC unary (raw bytes)"] = Grpc(request, reply_bytes)
            rows = interleaved(links, args.n, args.warmup, args.block)
        finally:
            for link in links.values():
                link.close()
    g50, g99 = np.percentile(rows["gRPC unary (raw bytes)"], [50, 99])
    print("\n| transport               | p50 us | p99 us | p50 / gRPC | p99 / gRPC |")
    print("|-------------------------|--------|--------|------------|------------|")
    for name, t in rows.items():
        p50, p99 = np.percentile(t, [50, 99])
        print(f"| {name:<23} | {p50:>6.0f} | {p99:>6.0f} | {p50 / g50:>10.2f} | {p99 / g99:>10.2f} |")
    print("goal: <= 0.5x gRPC at p50, <= 0.8x at p99")


if __name__ == "__main__":
    main()
