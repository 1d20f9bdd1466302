"""Message schema: msgpack header + raw array buffers (+ optional HMAC tag), validated on receipt.

Frames of one message::

    [header, array_0, ..., array_{n-1}, (tag)]

header (msgpack map): ``v`` (protocol version), ``kind`` (see KINDS), ``seq`` (int), ``t``
(float: the observation time this message refers to, the node's monotonic clock),
``arrays`` (list of ``[name, dtype, shape]``), ``meta`` (map str -> str/int/float/bool/None).
tag: HMAC-SHA256 over every preceding frame, each prefixed by its 8-byte length.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

VERSION = 1
KINDS = ("obs", "chunk", "reset", "error", "ping", "pong")
DTYPES = ("uint8", "int32", "int64", "float32", "float64", "bool")
_BY_DTYPE = {np.dtype(n): n for n in DTYPES}  # dtype.name is slow on the hot path
_ITEMSIZE = {n: np.dtype(n).itemsize for n in DTYPES}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
TAG_BYTES = 32


class MessageError(ValueError):
    """A received message broke the schema; the message is dropped, the receiver carries on."""


@dataclass(frozen=True)
class Limits:
    """Bounds on what a receiver accepts."""

    max_header_bytes: int = 16 * 1024
    max_arrays: int = 16
    max_ndim: int = 4
    max_array_bytes: int = 8 * 1024 * 1024
    max_message_bytes: int = 32 * 1024 * 1024
    max_meta_items: int = 32
    max_string: int = 1024


@dataclass
class Message:
    kind: str
    seq: int = 0
    t: float = 0.0
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _tag(key: bytes, frames: Sequence[bytes | memoryview]) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for f in frames:
        mv = memoryview(f)
        mac.update(struct.pack("<Q", mv.nbytes))
        mac.update(mv)
    return mac.digest()


def encode(msg: Message, key: bytes | None = None) -> list[bytes | memoryview]:
    """Frames for ``msg``; arrays travel as their raw bytes (C order), no copy when contiguous."""
    if msg.kind not in KINDS:
        raise MessageError(f"unknown message kind {msg.kind!r}")
    specs, bufs = [], []
    for name, arr in msg.arrays.items():
        arr = np.ascontiguousarray(arr)
        dtype = _BY_DTYPE.get(arr.dtype)
        if dtype is None:
            raise MessageError(f"array {name!r}: dtype {arr.dtype} not allowed (allowed: {DTYPES})")
        specs.append([name, dtype, list(arr.shape)])
        bufs.append(memoryview(arr).cast("B") if arr.nbytes else b"")
    header = msgpack.packb(
        {"v": VERSION, "kind": msg.kind, "seq": int(msg.seq), "t": float(msg.t), "arrays": specs, "meta": msg.meta},
        use_bin_type=True,
    )
    frames: list[bytes | memoryview] = [header, *bufs]
    if key is not None:
        frames.append(_tag(key, frames))
    return frames


def _refuse_ext(code: int, data: bytes):
    raise MessageError(f"msgpack extension type {code} refused")


def _check_meta(meta: Any, limits: Limits) -> dict[str, Any]:
    if not isinstance(meta, dict) or len(meta) > limits.max_meta_items:
        raise MessageError("meta must be a map of at most %d items" % limits.max_meta_items)
    for k, v in meta.items():
        if not isinstance(k, str) or len(k) > 64:
            raise MessageError("meta keys must be short strings")
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise MessageError(f"meta[{k!r}] must be a plain value, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise MessageError(f"meta[{k!r}] is not finite")
    return meta


def decode(frames: Sequence[bytes | memoryview], key: bytes | None = None, limits: Limits = Limits()) -> Message:
    """Validate and decode received frames; raises :class:`MessageError` on anything off-schema."""
    if not frames:
        raise MessageError("empty message")
    total = sum(memoryview(f).nbytes for f in frames)
    if total > limits.max_message_bytes:
        raise MessageError(f"message of {total} bytes exceeds {limits.max_message_bytes}")
    if key is not None:
        if len(frames) < 2 or memoryview(frames[-1]).nbytes != TAG_BYTES:
            raise MessageError("missing authentication tag")
        if not hmac.compare_digest(bytes(frames[-1]), _tag(key, frames[:-1])):
            raise MessageError("authentication tag does not match")
        frames = frames[:-1]
    head = bytes(frames[0])
    if len(head) > limits.max_header_bytes:
        raise MessageError(f"header of {len(head)} bytes exceeds {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(
            head, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True,
            max_str_len=limits.max_string, max_bin_len=0, max_array_len=64, max_map_len=64, max_ext_len=0,
        )
    except MessageError:
        raise
    except Exception as exc:  # msgpack raises several types for garbage input
        raise MessageError(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise MessageError("header must be a map")
    if set(header) != {"v", "kind", "seq", "t", "arrays", "meta"}:
        raise MessageError(f"header keys must be v, kind, seq, t, arrays, meta; got {sorted(map(str, header))}")
    if header["v"] != VERSION:
        raise MessageError(f"protocol version {header['v']!r} != {VERSION}")
    kind, seq, t = header["kind"], header["seq"], header["t"]
    if kind not in KINDS:
        raise MessageError(f"unknown message kind {kind!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63:
        raise MessageError("seq must be a non-negative integer")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise MessageError("t must be a finite number")
    specs = header["arrays"]
    if not isinstance(specs, list) or len(specs) > limits.max_arrays:
        raise MessageError(f"arrays must be a list of at most {limits.max_arrays}")
    if len(frames) != 1 + len(specs):
        raise MessageError(f"{len(specs)} arrays declared but {len(frames) - 1} buffers sent")
    arrays: dict[str, np.ndarray] = {}
    for spec, buf in zip(specs, frames[1:]):
        if not (isinstance(spec, list) and len(spec) == 3):
            raise MessageError("each array spec must be [name, dtype, shape]")
        name, dtype, shape = spec
        if not isinstance(name, str) or not _NAME.match(name) or name in arrays:
            raise MessageError(f"bad or repeated array name {name!r}")
        if dtype not in DTYPES:
            raise MessageError(f"array {name!r}: dtype {dtype!r} not allowed")
        if not (isinstance(shape, list) and len(shape) <= limits.max_ndim
                and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 2**31 for s in shape)):
            raise MessageError(f"array {name!r}: bad shape {shape!r}")
        nbytes = math.prod(shape) * _ITEMSIZE[dtype]
        if nbytes > limits.max_array_bytes:
            raise MessageError(f"array {name!r}: {nbytes} bytes exceeds {limits.max_array_bytes}")
        mv = memoryview(buf)
        if mv.nbytes != nbytes:
            raise MessageError(f"array {name!r}: buffer has {mv.nbytes} bytes, shape needs {nbytes}")
        arrays[name] = np.frombuffer(mv, dtype=dtype).reshape(shape)
    return Message(kind=kind, seq=seq, t=float(t), arrays=arrays, meta=_check_meta(header["meta"], limits))
