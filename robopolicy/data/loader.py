"""Torch ``Dataset`` for training on any LeRobot v3.0 dataset, read from its training cache.

    ds = TrainingDataset("datasets/pf_dt", cameras=["front"], context_strides=(0, 1, 4, 16),
                         horizon=1, action_key="oracle.waypoints", labels=["label.target_box"])
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=4)

One sample (``T = len(context_strides)``, ``H = horizon``)::

    observation.images.<role>  uint8 (T, C, H_img, W_img)  frame t - context_strides[i] at [i]
    observation.state          float32 (T, D)               same context as the images
    observation_is_pad         bool (T,)     True where t - stride fell before the episode start
                                             (the episode's first frame is repeated there)
    action                     (H, *A)       action_key at t, t+1, ..., t+H-1: an action chunk
                                             (H, A), or for ``oracle.waypoints`` (K, 3) per step
                                             (H, K, 3) (horizon=1: the K waypoints at t)
    action_is_pad              bool (H,)     True past the episode end (the last step is repeated)
    task                       str           the language instruction; task_index int64 ()
    <label key>                the label at t, its feature's shape (``()`` for shape-(1,) ones)
    index, episode_index, frame_index        int64 (); timestamp float32 ()

Images stay uint8: normalize on the GPU with ``stats`` (``(C, 1, 1)`` in [0, 1] units). Context
and chunk follow LeRobot's ``delta_timestamps`` semantics (clamp to the episode, flag as pad),
so a sample equals what ``LeRobotDataset`` returns for the same deltas, without decoding video.

Which dataset key plays which role comes from a :class:`FeatureMap`, so any LeRobot v3.0
dataset works, whatever its camera or state names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from robopolicy.data.cache import BOOKKEEPING_KEYS, CAMERA_DTYPES, DatasetError, TrainingCache, ensure_cache

IMAGE_PREFIX = "observation.images."


@dataclass
class FeatureMap:
    """Dataset keys → loader roles."""

    cameras: dict[str, str] | list[str] | None = None
    """Camera role → dataset key (``{"front": "observation.images.top"}``), or a list of keys or
    short names (``["front"]``); ``None``: every camera, under its own short name."""
    state: str | None = "observation.state"
    """Key of the proprioceptive state, or ``None`` for image-only policies."""
    env_state: str | None = None
    """Key of a low-dimensional scene state (``observation.environment_state``) fed to the policy as
    a second proprio token; ``None``: not used. The trainer loads it at time t like a label."""
    action: str = "action"
    """Key of the prediction target: ``action`` (a chunk) or e.g. ``oracle.waypoints``."""
    labels: list[str] = field(default_factory=list)
    """Extra per-step features returned at time t under their own key (``label.target_box``)."""


@dataclass
class LoaderConfig:
    """Everything the training loader needs; loadable with ``robopolicy.config.load_config``."""

    dataset: str = ""
    """LeRobot v3.0 dataset directory."""
    features: FeatureMap = field(default_factory=FeatureMap)
    context_strides: list[int] = field(default_factory=lambda: [0, 1, 4, 16])
    """Observation context: frames t - s for each s, in this order."""
    horizon: int = 16
    """Steps of the action chunk / waypoint targets."""
    episodes: list[int] | None = None
    """Episode indices to use (e.g. a train split); ``None``: all."""
    cache_dir: str | None = None
    """Where training caches live; ``None``: ``$ROBOPOLICY_CACHE_DIR`` or ``~/.cache/robopolicy/training``."""
    full_digest: bool = False
    """Key the cache on the videos' bytes too, not only their size and mtime."""


def _fix(setting: str) -> str:
    """How to stop ``setting`` asking for a feature the dataset lacks."""
    if setting.startswith("loss."):
        return f"set {setting}: 0, or use a dataset that has it"
    if setting.endswith("labels"):
        return f"remove it from {setting}"
    return f"set {setting} to one of the features, or null"


class TrainingDataset(torch.utils.data.Dataset):
    """Samples with temporal context and action chunks; see the module docstring for shapes."""

    def __init__(
        self,
        root: str | Path,
        cameras: Mapping[str, str] | Sequence[str] | None = None,
        state_key: str | None = "observation.state",
        action_key: str = "action",
        labels: Sequence[str] | Mapping[str, str] = (),
        context_strides: Sequence[int] = (0, 1, 4, 16),
        horizon: int = 16,
        episodes: Sequence[int] | None = None,
        cache_dir: str | Path | None = None,
        full_digest: bool = False,
        progress: bool = True,
    ):
        self.root = Path(root)
        self.entry = ensure_cache(root, cache_dir, full_digest=full_digest, progress=progress)
        self.cache = TrainingCache(self.entry)
        features = self.cache.features

        def check(key: str, what: str, numeric: bool = True, setting: str | None = None) -> str:
            if key not in features:
                if setting:  # the error names the setting that asked for the feature
                    raise DatasetError(f"{setting} asks for the feature {key!r}, which dataset {self.root} lacks "
                                       f"(features: {sorted(features)}): {_fix(setting)}")
                raise DatasetError(f"{what} feature {key!r} not in dataset {self.root}; "
                                   f"features: {sorted(features)}")
            if numeric and features[key]["dtype"] in CAMERA_DTYPES:
                raise DatasetError(f"{what} feature {key!r} is a camera, expected a numeric feature")
            return key

        self.cameras = self._resolve_cameras(cameras)
        for role, key in self.cameras.items():
            check(key, f"camera {role!r}", numeric=False)
            if features[key]["dtype"] not in CAMERA_DTYPES:
                raise DatasetError(f"camera {role!r}: feature {key!r} is not a camera "
                                   f"(cameras: {self.cache.cameras})")
        self.state_key = check(state_key, "state") if state_key is not None else None
        self.action_key = check(action_key, "action")
        settings = dict(labels) if isinstance(labels, Mapping) else {}
        self.labels = [check(k, "label", setting=settings.get(k)) for k in labels]
        strides = [int(s) for s in context_strides]
        if not strides or min(strides) < 0:
            raise ValueError(f"context_strides must be non-negative steps back, got {list(context_strides)}")
        if int(horizon) < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.context_strides = np.asarray(strides, dtype=np.int64)
        self.horizon = int(horizon)
        self._future = np.arange(self.horizon, dtype=np.int64)

        eps = self.cache.episodes
        by_index = {e["episode_index"]: e for e in eps}
        if episodes is not None:
            missing = [e for e in episodes if e not in by_index]
            if missing:
                raise DatasetError(f"episodes {missing} not in dataset {self.root} "
                                   f"(episode indices {min(by_index, default=0)}..{max(by_index, default=-1)})")
            eps = [by_index[e] for e in episodes]
        eps = [e for e in eps if e["to"] > e["from"]]
        self.episodes = [e["episode_index"] for e in eps]
        self._rows = np.concatenate([np.arange(e["from"], e["to"]) for e in eps]) if eps else np.zeros(0, np.int64)
        self._start = np.concatenate([np.full(e["to"] - e["from"], e["from"]) for e in eps]) if eps else self._rows
        self._end = np.concatenate([np.full(e["to"] - e["from"], e["to"]) for e in eps]) if eps else self._rows

        low = self.cache.lowdim
        self._state = low[self.state_key].astype(np.float32, copy=False) if self.state_key else None
        self._action = low[self.action_key].astype(np.float32, copy=False)
        self._labels = {k: low[k] for k in self.labels}
        self._task_index = low["task_index"].astype(np.int64, copy=False)
        self._episode_index = low["episode_index"].astype(np.int64, copy=False)
        self._frame_index = low["frame_index"].astype(np.int64, copy=False)
        self._timestamp = low["timestamp"].astype(np.float32, copy=False)

    @classmethod
    def from_config(cls, cfg: LoaderConfig, progress: bool = True) -> "TrainingDataset":
        """Build from a :class:`LoaderConfig`."""
        if not cfg.dataset:
            raise DatasetError("loader config: 'dataset' (the dataset directory) is empty")
        f = cfg.features
        return cls(cfg.dataset, cameras=f.cameras, state_key=f.state, action_key=f.action, labels=f.labels,
                   context_strides=cfg.context_strides, horizon=cfg.horizon, episodes=cfg.episodes,
                   cache_dir=cfg.cache_dir, full_digest=cfg.full_digest, progress=progress)

    def _resolve_cameras(self, cameras) -> dict[str, str]:
        def full(name: str) -> str:
            return name if name in self.cache.features else IMAGE_PREFIX + name

        def short(key: str) -> str:
            return key[len(IMAGE_PREFIX):] if key.startswith(IMAGE_PREFIX) else key

        if cameras is None:
            return {short(k): k for k in self.cache.cameras}
        if isinstance(cameras, Mapping):
            return {str(role): full(key) for role, key in cameras.items()}
        return {short(full(name)): full(name) for name in cameras}

    @property
    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        """Normalization statistics under the sample's keys (roles), ready for a checkpoint."""
        raw = self.cache.stats
        out = {IMAGE_PREFIX + role: raw[key] for role, key in self.cameras.items() if key in raw}
        if self.state_key and self.state_key in raw:
            out["observation.state"] = raw[self.state_key]
        if self.action_key in raw:
            out["action"] = raw[self.action_key]
        out.update({k: raw[k] for k in self.labels if k in raw and k not in BOOKKEEPING_KEYS})
        return out

    def relative_action_stats(self, dims: Sequence[int], max_samples: int = 200_000,
                              seed: int = 0) -> dict[str, np.ndarray]:
        """Action statistics with ``dims`` replaced by those of the offsets ``action[t + k] -
        state[t]`` over the chunk steps ``k < horizon`` inside the episode (what a policy with
        ``relative_action`` learns); at most ``max_samples`` frames t, drawn at random."""
        if self._state is None:
            raise DatasetError("relative actions need a state feature (data.features.state)")
        dims = [int(d) for d in dims]
        limit = min(self._action.shape[-1], self._state.shape[-1])
        if any(not 0 <= d < limit for d in dims):
            raise DatasetError(f"model.relative_action {dims}: dims must be below {limit} (action "
                               f"{self._action.shape[-1]}, state {self._state.shape[-1]} values)")
        base = {k: np.asarray(v, dtype=np.float32).copy() for k, v in self.stats["action"].items()}
        if not dims:
            return base
        idx = np.arange(len(self._rows))
        if len(idx) > max_samples:
            idx = np.random.default_rng(seed).choice(idx, max_samples, replace=False)
        rows, ends = self._rows[idx], self._end[idx]
        future = rows[:, None] + self._future[None]  # (N, H)
        valid = future < ends[:, None]
        offsets = self._action[np.minimum(future, ends[:, None] - 1)][..., dims] - self._state[rows][:, None, dims]
        values = offsets[valid].astype(np.float64)  # (M, len(dims))
        for name, value in (("mean", values.mean(0)), ("std", values.std(0)), ("min", values.min(0)),
                            ("max", values.max(0)), ("q01", np.quantile(values, 0.01, axis=0)),
                            ("q99", np.quantile(values, 0.99, axis=0))):
            if name in base:
                base[name][dims] = value
        if "count" in base:
            base["count"] = np.asarray(len(values))
        return base

    @property
    def frame_index(self) -> np.ndarray:
        """Each sample's frame index within its episode, ``(len(self),)`` int64."""
        return self._frame_index[self._rows]

    @property
    def fps(self) -> int:
        return self.cache.fps

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, idx: int) -> dict:
        n = len(self._rows)
        if not isinstance(idx, (int, np.integer)):
            raise TypeError(f"index must be an int, got {type(idx).__name__}")
        if not -n <= idx < n:
            raise IndexError(f"index {idx} out of range for a dataset of {n} samples ({self.root})")
        idx = int(idx) % n
        row = int(self._rows[idx])
        start, end = int(self._start[idx]), int(self._end[idx])
        past = row - self.context_strides
        context = np.maximum(past, start)
        future = row + self._future
        chunk = np.minimum(future, end - 1)

        item: dict = {}
        for role, key in self.cameras.items():
            item[IMAGE_PREFIX + role] = torch.from_numpy(self.cache.read_frames(key, context))
        if self._state is not None:
            item["observation.state"] = torch.from_numpy(self._state[context])
        item["observation_is_pad"] = torch.from_numpy(past < start)
        item["action"] = torch.from_numpy(self._action[chunk])
        item["action_is_pad"] = torch.from_numpy(future >= end)
        task_index = int(self._task_index[row])
        item["task"] = self.cache.tasks[task_index]
        item["task_index"] = torch.tensor(task_index)
        for key, values in self._labels.items():
            item[key] = torch.from_numpy(np.array(values[row]))
        item["index"] = torch.tensor(row)
        item["episode_index"] = torch.tensor(int(self._episode_index[row]))
        item["frame_index"] = torch.tensor(int(self._frame_index[row]))
        item["timestamp"] = torch.tensor(float(self._timestamp[row]))
        return item

    def __repr__(self) -> str:
        return (f"TrainingDataset({self.root}, samples={len(self)}, episodes={len(self.episodes)}, "
                f"cameras={self.cameras}, state={self.state_key!r}, action={self.action_key!r}, "
                f"labels={self.labels}, context_strides={self.context_strides.tolist()}, horizon={self.horizon})")
