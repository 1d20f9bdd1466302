"""MP4 writing through PyAV (no system FFmpeg needed), written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import av
import numpy as np

from robopolicy.utils.files import atomic_file


def _pick_codec() -> str:
    for name in ("libx264", "libopenh264", "h264", "mpeg4"):
        if name in av.codecs_available:
            try:
                av.codec.Codec(name, "w")
                return name
            except Exception:  # codec listed but no encoder in this build
                continue
    raise RuntimeError("PyAV has no H.264 or MPEG-4 encoder in this build")


def write_mp4(path: str | Path, frames: Iterable[np.ndarray], fps: float) -> Path:
    """Encode uint8 HxWx3 RGB frames to ``path``; the file appears only once complete."""
    path = Path(path)
    codec = _pick_codec()
    count = 0
    with atomic_file(path) as tmp:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = None
            for frame in frames:
                frame = np.ascontiguousarray(frame)
                if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[2] != 3:
                    raise ValueError(f"video frames must be uint8 HxWx3, got {frame.dtype} {frame.shape}")
                if stream is None:
                    h, w = frame.shape[:2]
                    # Encoders need even sizes: pad by one pixel where needed.
                    h2, w2 = h + h % 2, w + w % 2
                    stream = container.add_stream(codec, rate=int(round(fps)))
                    stream.width, stream.height, stream.pix_fmt = w2, h2, "yuv420p"
                    if codec == "libx264":
                        stream.options = {"crf": "20", "preset": "veryfast"}
                if frame.shape[0] != stream.height or frame.shape[1] != stream.width:
                    padded = np.zeros((stream.height, stream.width, 3), np.uint8)
                    padded[: frame.shape[0], : frame.shape[1]] = frame
                    frame = padded
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    container.mux(packet)
                count += 1
            if stream is None:
                raise ValueError("no frames to write")
            for packet in stream.encode():
                container.mux(packet)
    return path


def read_mp4(path: str | Path) -> np.ndarray:
    """Decode an mp4 into a (T, H, W, 3) uint8 array (for tests and inspection)."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def hstack_frames(views: list[np.ndarray]) -> np.ndarray:
    """Put views side by side, resizing each to the tallest height (nearest neighbour)."""
    height = max(v.shape[0] for v in views)
    out = []
    for v in views:
        if v.shape[0] != height:
            scale = height / v.shape[0]
            rows = (np.arange(height) / scale).astype(int)
            cols = (np.arange(int(round(v.shape[1] * scale))) / scale).astype(int)
            v = v[rows][:, cols]
        out.append(v)
    return np.concatenate(out, axis=1)
