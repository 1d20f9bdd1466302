"""Observation → chunk round trip: our ZeroMQ + msgpack transport vs a gRPC unary call.

Request: a 96×96×3 uint8 frame plus a 6-float state (and the task string); reply: a (20, 6)
float32 chunk. Ours: the real policy worker process (``hold`` policy) behind a PolicyServer,
validated on both ends, over ipc (local default) and tcp://127.0.0.1, authenticated and encrypted
with a shared key (CURVE, as a keyed deployment runs; ``--no-key``: the unauthenticated link,
ipc and loopback tcp opted out). gRPC: a server process
with a generic handler and raw-bytes (de)serializers carrying the same bytes as our frames, and
answering with pre-built reply bytes of our reply's size (no parsing: favours gRPC).

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


def bench_ours(endpoint: str, n: int, warmup: int, key_file: str | None) -> np.ndarray:
    cmd = [sys.executable, "-m", "robopolicy.deploy.worker", "--endpoint", endpoint, "--policy", "hold"]
    cmd += ["--auth-key-file", key_file] if key_file else ["--insecure-loopback"]
    proc = subprocess.Popen(cmd)
    key = open(key_file, "rb").read().strip() if key_file else None
    client = PolicyClient(endpoint, key, insecure_loopback=key is None)
    msg = _request()
    times = []
    try:
        for i in range(n + warmup):
            msg.seq = i + 1
            msg.t = time.monotonic()
            t0 = time.perf_counter()
            client.send(msg)
            while not client.wait(5000):
                raise RuntimeError("no reply from the worker")
            reply = client.poll()
            dt = time.perf_counter() - t0
            assert reply and reply[0].kind == "chunk" and reply[0].arrays["action"].shape == (20, 6)
            if i >= warmup:
                times.append(dt)
    finally:
        client.close()
        proc.terminate()
        proc.wait()
    return np.array(times) * 1e6


def bench_grpc(n: int, warmup: int, request: bytes, reply_bytes: int) -> np.ndarray:
    import grpc

    port = _free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-grpc", str(port), "--reply-bytes", str(reply_bytes)])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    call = channel.unary_unary("/bench.Policy/Infer", request_serializer=None, response_deserializer=None)
    times = []
    try:
        for i in range(n + warmup):
            t0 = time.perf_counter()
            out = call(request)
            dt = time.perf_counter() - t0
            assert len(out) == reply_bytes
            if i >= warmup:
                times.append(dt)
    finally:
        channel.close()
        proc.terminate()
        proc.wait()
    return np.array(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
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
    print(f"round trip of {len(request)} request bytes / {reply_bytes} reply bytes, n={args.n}; "
          f"{os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"{'no key' if args.no_key else 'keyed (CURVE)'}")
    with tempfile.TemporaryDirectory(prefix="rp-tr-") as wd:
        key_file = None
        if not args.no_key:
            key_file = os.path.join(wd, "key")
            with open(key_file, "w") as f:
                f.write(secrets.token_hex(32))
        tag = "" if args.no_key else " +key"
        rows = [
            (f"ours zmq ipc{tag}", bench_ours(f"ipc://{wd}/b.sock", args.n, args.warmup, key_file)),
            (f"ours zmq tcp lo{tag}", bench_ours(f"tcp://127.0.0.1:{_free_port()}", args.n, args.warmup, key_file)),
            ("gRPC unary (raw bytes)", bench_grpc(args.n, args.warmup, request, reply_bytes)),
        ]
    g50, g99 = np.percentile(rows[-1][1], [50, 99])
    print("\n| transport               | p50 us | p99 us | p50 / gRPC | p99 / gRPC |")
    print("|-------------------------|--------|--------|------------|------------|")
    for name, t in rows:
        p50, p99 = np.percentile(t, [50, 99])
        print(f"| {name:<23} | {p50:>6.0f} | {p99:>6.0f} | {p50 / g50:>10.2f} | {p99 / g99:>10.2f} |")
    print("goal: <= 0.5x gRPC at p50, <= 0.8x at p99")


if __name__ == "__main__":
    main()
