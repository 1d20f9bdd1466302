"""Normalization statistics computed in one streaming pass.

Each feature gets ``mean``, ``std``, ``min``, ``max``, ``q01``, ``q99`` and ``count``, with the
feature's own shape (images: per channel, shape ``(C, 1, 1)`` in ``[0, 1]`` units, as LeRobot
stores them). Policies copy the dict into their checkpoint.

- ``mean``/``std``: exact (float64, Chan's parallel update of mean and sum of squares).
- ``min``/``max``: exact.
- ``q01``/``q99`` of numeric features: from a per-dimension histogram of ``bins`` bins whose range
  doubles whenever new data falls outside it, so no range must be known in advance. Each order
  statistic is placed inside its true bin and interpolated as ``numpy.quantile`` does ('linear'),
  so the error is at most one bin width: ``2 * (max - min) / bins`` typically, ``4 * (max - min)
  / bins`` at worst (0.2% of the range at the default 2048 bins).
- images (uint8): a 256-bin histogram per channel, so every statistic is exact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from robopolicy.utils.files import atomic_write_text

STAT_NAMES = ("mean", "std", "min", "max", "q01", "q99")


class StreamingStats:
    """Statistics of a numeric feature of shape ``shape``, fed in batches ``(N, *shape)``."""

    def __init__(self, shape: tuple[int, ...], bins: int = 2048):
        if bins < 2 or bins % 2:
            raise ValueError(f"bins must be an even number >= 2, got {bins}")
        self.shape = tuple(shape)
        self.dims = int(np.prod(self.shape, dtype=np.int64))
        self.bins = bins
        self.count = 0
        self._mean = np.zeros(self.dims)
        self._m2 = np.zeros(self.dims)
        self._min = np.full(self.dims, np.inf)
        self._max = np.full(self.dims, -np.inf)
        self._lo = np.zeros(self.dims)  # left edge of bin 0, per dimension
        self._width = np.zeros(self.dims)  # bin width per dimension (0: not initialised)
        self._hist = np.zeros((self.dims, bins), dtype=np.int64)

    def update(self, batch: np.ndarray) -> None:
        """Add ``batch`` of shape ``(N, *shape)``; non-finite values raise ``ValueError``."""
        x = np.asarray(batch, dtype=np.float64).reshape(-1, self.dims)
        n = x.shape[0]
        if n == 0:
            return
        if not np.isfinite(x).all():
            raise ValueError(f"{int((~np.isfinite(x)).any(axis=1).sum())} rows hold NaN or inf")
        bmin, bmax = x.min(axis=0), x.max(axis=0)
        bmean = x.mean(axis=0)
        bm2 = ((x - bmean) ** 2).sum(axis=0)
        total = self.count + n
        delta = bmean - self._mean
        self._mean = self._mean + delta * (n / total)
        self._m2 = self._m2 + bm2 + delta**2 * (self.count * n / total)
        self.count = total
        self._min = np.minimum(self._min, bmin)
        self._max = np.maximum(self._max, bmax)
        self._fit_range(bmin, bmax)
        idx = np.floor((x - self._lo) / self._width).astype(np.int64)
        np.clip(idx, 0, self.bins - 1, out=idx)
        idx += np.arange(self.dims) * self.bins
        self._hist += np.bincount(idx.ravel(), minlength=self.dims * self.bins).reshape(self.dims, self.bins)

    def _fit_range(self, bmin: np.ndarray, bmax: np.ndarray) -> None:
        """Grow each dimension's histogram range (doubling, merging bin pairs) to hold the batch."""
        fresh = self._width == 0
        if fresh.any():
            span = bmax[fresh] - bmin[fresh]
            tiny = np.maximum(np.abs(bmin[fresh]), 1.0) * 1e-9
            self._lo[fresh] = bmin[fresh]
            self._width[fresh] = np.maximum(span, tiny) / self.bins
        half = self.bins // 2
        for d in np.flatnonzero((bmin < self._lo) | (bmax >= self._lo + self.bins * self._width)):
            while bmin[d] < self._lo[d] or bmax[d] > self._lo[d] + self.bins * self._width[d]:
                merged = self._hist[d, 0::2] + self._hist[d, 1::2]
                self._hist[d] = 0
                if bmin[d] < self._lo[d]:  # old range becomes the upper half
                    self._lo[d] -= self.bins * self._width[d]
                    self._hist[d, half:] = merged
                else:  # old range becomes the lower half
                    self._hist[d, :half] = merged
                self._width[d] *= 2

    def _value_at_rank(self, d: int, cdf: np.ndarray, rank: int) -> float:
        """Estimate of the ``rank``-th smallest value of dimension ``d`` (inside its true bin)."""
        b = min(int(np.searchsorted(cdf, rank, side="right")), self.bins - 1)
        before = cdf[b - 1] if b > 0 else 0
        frac = (rank - before + 0.5) / max(self._hist[d, b], 1)  # ranks spread evenly in the bin
        return self._lo[d] + (b + min(max(frac, 0.0), 1.0)) * self._width[d]

    def quantile(self, q: float) -> np.ndarray:
        """``q``-quantile per dimension, within one bin width of ``numpy.quantile``; shape ``shape``."""
        out = np.empty(self.dims)
        pos = q * (self.count - 1)  # numpy's 'linear' method: interpolate between order statistics
        lo_rank, hi_rank = int(np.floor(pos)), int(np.ceil(pos))
        for d in range(self.dims):
            cdf = np.cumsum(self._hist[d])
            lo_v = self._value_at_rank(d, cdf, lo_rank)
            hi_v = self._value_at_rank(d, cdf, hi_rank)
            out[d] = lo_v + (pos - lo_rank) * (hi_v - lo_v)
        return np.clip(out, self._min, self._max).reshape(self.shape)

    @property
    def bin_width(self) -> np.ndarray:
        """Current histogram bin width per dimension (the quantiles' error bound), shape ``shape``."""
        return self._width.reshape(self.shape)

    def result(self) -> dict[str, np.ndarray]:
        """The statistics, each of shape ``shape`` (float64), plus ``count``."""
        if self.count == 0:
            raise ValueError("no data was added")
        std = np.sqrt(self._m2 / self.count)
        return {
            "mean": self._mean.reshape(self.shape),
            "std": std.reshape(self.shape),
            "min": self._min.reshape(self.shape),
            "max": self._max.reshape(self.shape),
            "q01": self.quantile(0.01),
            "q99": self.quantile(0.99),
            "count": np.array([self.count]),
        }


class ImageStats:
    """Exact per-channel statistics of uint8 images fed as ``(N, C, H, W)``, reported in [0, 1]."""

    def __init__(self, channels: int):
        self.channels = channels
        self._hist = np.zeros((channels, 256), dtype=np.int64)
        self.count = 0  # images

    def update(self, images: np.ndarray) -> None:
        """Add uint8 images of shape ``(N, C, H, W)`` or one image ``(C, H, W)``."""
        images = np.asarray(images)
        if images.dtype != np.uint8:
            raise ValueError(f"images must be uint8, got {images.dtype}")
        if images.ndim == 3:
            images = images[None]
        for c in range(self.channels):
            self._hist[c] += np.bincount(images[:, c].ravel(), minlength=256)
        self.count += images.shape[0]

    def result(self) -> dict[str, np.ndarray]:
        """The statistics, each of shape ``(C, 1, 1)`` in [0, 1] units, plus ``count`` (images)."""
        if self.count == 0:
            raise ValueError("no images were added")
        values = np.arange(256, dtype=np.float64) / 255.0
        n = self._hist.sum(axis=1)
        mean = (self._hist * values).sum(axis=1) / n
        var = (self._hist * (values - mean[:, None]) ** 2).sum(axis=1) / n
        cdf = np.cumsum(self._hist, axis=1)
        nz = self._hist > 0

        def quantile(q: float) -> np.ndarray:
            out = np.empty(self.channels)
            for c in range(self.channels):  # linear interpolation between order statistics
                pos = q * (n[c] - 1)
                lo_rank, hi_rank = int(np.floor(pos)), int(np.ceil(pos))
                lo_v = values[np.searchsorted(cdf[c], lo_rank, side="right")]
                hi_v = values[np.searchsorted(cdf[c], hi_rank, side="right")]
                out[c] = lo_v + (pos - lo_rank) * (hi_v - lo_v)
            return out

        shape = (self.channels, 1, 1)
        return {
            "mean": mean.reshape(shape),
            "std": np.sqrt(var).reshape(shape),
            "min": np.array([values[np.argmax(nz[c])] for c in range(self.channels)]).reshape(shape),
            "max": np.array([values[255 - np.argmax(nz[c, ::-1])] for c in range(self.channels)]).reshape(shape),
            "q01": quantile(0.01).reshape(shape),
            "q99": quantile(0.99).reshape(shape),
            "count": np.array([self.count]),
        }


def stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict:
    """Nested lists, ready for ``json.dump`` (and for a checkpoint)."""
    return {key: {name: np.asarray(v).tolist() for name, v in entry.items()} for key, entry in stats.items()}


def stats_from_json(data: Mapping) -> dict[str, dict[str, np.ndarray]]:
    """Inverse of :func:`stats_to_json` (float32 arrays; ``count`` as int64)."""
    out = {}
    for key, entry in data.items():
        out[key] = {name: np.asarray(v, dtype=np.int64 if name == "count" else np.float32) for name, v in entry.items()}
    return out


def save_stats(stats: Mapping[str, Mapping[str, np.ndarray]], path: str | Path) -> Path:
    """Write ``stats`` as JSON, atomically."""
    return atomic_write_text(path, json.dumps(stats_to_json(stats), indent=1))


def load_stats(path: str | Path) -> dict[str, dict[str, np.ndarray]]:
    """Read statistics written by :func:`save_stats`."""
    path = Path(path)
    try:
        return stats_from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(f"normalization statistics not found: {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
