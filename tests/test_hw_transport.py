"""Transport: schema validation, authentication, bind policy, and both ends surviving bad input."""

from __future__ import annotations

import os
import pickle
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from hardware.transport import Limits, Message, MessageError, PolicyClient, PolicyServer, TransportError, check_bind, decode, encode
from robopolicy.deploy.worker import HoldPolicy, serve

KEY = b"k" * 32


def _obs():
    return Message("obs", 7, 12.5, {"observation.state": np.arange(6, dtype=np.float32),
                                    "observation.images.front": np.zeros((96, 96, 3), np.uint8)}, {"task": "reach"})


def test_round_trip_keeps_arrays_and_meta():
    msg = decode(encode(_obs()))
    assert msg.kind == "obs" and msg.seq == 7 and msg.t == 12.5 and msg.meta == {"task": "reach"}
    assert msg.arrays["observation.images.front"].shape == (96, 96, 3)
    np.testing.assert_array_equal(msg.arrays["observation.state"], np.arange(6, dtype=np.float32))


def test_hmac_tag_is_checked():
    frames = encode(_obs(), KEY)
    assert decode(frames, KEY).seq == 7
    with pytest.raises(MessageError, match="tag"):
        decode(frames, b"x" * 32)
    tampered = list(frames)
    tampered[1] = np.ones(6, np.float32).tobytes()
    with pytest.raises(MessageError, match="tag"):
        decode(tampered, KEY)
    with pytest.raises(MessageError, match="tag"):
        decode(encode(_obs()), KEY)  # unauthenticated sender


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/robopolicy_pwned",))


def _header(**over):
    h = {"v": 1, "kind": "obs", "seq": 1, "t": 0.0, "arrays": [], "meta": {}}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize("frames,match", [
    ([b""], "msgpack"),
    ([b"\xff\x00garbage"], "msgpack|map"),
    ([pickle.dumps(_Exploit())], "msgpack|map"),
    ([msgpack.packb(msgpack.ExtType(1, b"x"))], "extension|msgpack"),
    ([_header(kind="exec")], "kind"),
    ([_header(extra=1)], "keys"),
    ([_header(arrays=[["a", "object", [1]]]), b"x" * 8], "dtype"),
    ([_header(arrays=[["a", "float32", [4]]]), b"x" * 8], "buffer"),
    ([_header(arrays=[["a", "uint8", [1 << 30]]]), b""], "exceeds"),
    ([_header(arrays=[["a", "uint8", [1]]])], "declared"),
    ([_header(meta={"x": [1, 2]})], "plain"),
    ([_header(t=float("nan"))], "finite"),
    ([b"\x81" + msgpack.packb("k") + msgpack.packb("x" * 5000)], "msgpack"),
])
def test_malformed_messages_are_rejected(frames, match):
    with pytest.raises(MessageError, match=match):
        decode(frames)
    assert not os.path.exists("/tmp/robopolicy_pwned")


def test_oversized_message_rejected_by_limit():
    big = Message("obs", 1, 0.0, {"x": np.zeros(2_000_000, np.uint8)})
    with pytest.raises(MessageError, match="exceeds"):
        decode(encode(big), limits=Limits(max_array_bytes=1_000_000))


def test_network_bind_needs_a_key():
    check_bind("ipc:///tmp/x.sock", None)
    for ep in ("tcp://127.0.0.1:5555", "tcp://localhost:5555"):  # loopback: protected like the network
        with pytest.raises(TransportError, match="local user"):
            check_bind(ep, None)
        check_bind(ep, None, insecure_loopback=True)  # unless the user opts out
        check_bind(ep, KEY)
    for ep in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.4:5555"):
        with pytest.raises(TransportError):
            check_bind(ep, None)
        with pytest.raises(TransportError):
            check_bind(ep, None, insecure_loopback=True)
        with pytest.raises(TransportError):
            check_bind(ep, b"short")
        check_bind(ep, KEY)


def test_worker_survives_bad_messages_and_keeps_answering(tmp_path):
    ep = f"ipc://{tmp_path}/w.sock"
    server = PolicyServer(ep, limits=Limits(max_array_bytes=1 << 20))
    t = threading.Thread(target=serve, args=(server, HoldPolicy(horizon=5)), kwargs={"max_requests": 1}, daemon=True)
    t.start()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(ep)
    raw.send_multipart([pickle.dumps(_Exploit())])
    raw.send_multipart([b"\x00" * 100, b"\x01"])
    raw.send_multipart([_header(arrays=[["x", "uint8", [1 << 21]]]), b"\x00" * (1 << 21)])  # oversized
    time.sleep(0.2)
    client = PolicyClient(ep)
    client.send(_obs())
    replies = []
    end = time.monotonic() + 5
    while not replies and time.monotonic() < end:
        replies = client.poll()
        time.sleep(0.01)
    t.join(5)
    assert replies and replies[0].kind == "chunk" and replies[0].arrays["action"].shape == (5, 6)
    assert sum(server.rejected.values()) >= 2
    assert not os.path.exists("/tmp/robopolicy_pwned")
    raw.close(0)
    client.close()
    server.close()


def test_node_side_rejects_bad_replies_and_accepts_good_ones(tmp_path):
    ep = f"ipc://{tmp_path}/n.sock"
    ctx = zmq.Context.instance()
    fake_worker = ctx.socket(zmq.ROUTER)
    fake_worker.bind(ep)
    client = PolicyClient(ep)
    client.send(_obs())
    ident, *_ = fake_worker.recv_multipart()
    fake_worker.send_multipart([ident, pickle.dumps(_Exploit())])
    fake_worker.send_multipart([ident, _header(kind="chunk", arrays=[["action", "float64", [2, 3]]]), b"1234"])
    good = Message("chunk", 7, 12.5, {"action": np.zeros((2, 3), np.float32)}, {"dt": 0.05})
    fake_worker.send_multipart([ident, *encode(good)])
    got = []
    end = time.monotonic() + 5
    while not got and time.monotonic() < end:
        got = client.poll()
        time.sleep(0.01)
    assert len(got) == 1 and got[0].kind == "chunk"
    assert sum(client.rejected.values()) == 2 and client.last_reject
    client.close()
    fake_worker.close(0)
