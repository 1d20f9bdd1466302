"""Frozen-encoder features computed once per dataset frame and reused by every training step.

    feats = ensure_features(dataset, policy.vision)     # {camera role: (N, n, C) float16 array}

With frozen encoders a training step only needs each context frame's encoder output, which never
changes: encoding it once (here, with a progress bar) instead of ``T`` times per sample per
epoch is what makes training fast on a CPU. Row ``i`` of a feature array is global dataset row
``i`` (the ``index`` column), so context and chunk lookups stay plain integer indexing.

A feature file is keyed by the training cache entry (which carries the dataset's content key,
``robopolicy.data.cache.content_key``), the camera, and the encoder identity (timm names, image
size, grid and a digest of the encoder's weights): a changed dataset or encoder gets a new file,
so stale features are never read. Files are written under a temporary name and renamed when
complete, under a file lock (one builder when several trainers start at once).

Layout: ``<dir>/<dataset>-<camera>-<key>.npy`` (``(N, n, C)`` float16, or float32 when float16
would overflow) and a ``.json`` beside it with the key's ingredients.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from robopolicy.data.cache import default_cache_dir
from robopolicy.models.encoders import FusedVisionEncoder
from robopolicy.utils.files import atomic_file, atomic_write_text

FEATURE_FORMAT = 1
IN_MEMORY_BYTES = 4 << 30  # smaller feature files are read into RAM; larger ones stay memory-mapped


def default_feature_dir() -> Path:
    """``<training cache dir>/../features`` (``~/.cache/robopolicy/features`` by default)."""
    return default_cache_dir().parent / "features"


def feature_key(dataset, camera_key: str, encoder: FusedVisionEncoder, text_model: str | None = None) -> tuple[str, dict]:
    """Hex key and its ingredients for one camera of ``dataset`` (a ``TrainingDataset``);
    ``text_model``: the sentence model whose embeddings condition a FiLM encoder."""
    import timm

    parts = {"format": FEATURE_FORMAT, "cache_entry": dataset.entry.name, "camera": camera_key,
             "encoder": encoder.cache_key(), "timm": timm.__version__}
    if text_model is not None:
        parts["text_model"] = text_model
    digest = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=10).hexdigest()
    return digest, parts


@torch.inference_mode()
def _encode_all(dataset, camera_key: str, encoder: FusedVisionEncoder, out: np.ndarray, batch_size: int,
                device: torch.device, bar, text_fn=None) -> bool:
    """Fill ``out (N, n, C)``; returns False if a value does not fit ``out``'s dtype."""
    n = out.shape[0]
    ok = True
    for start in range(0, n, batch_size):
        rows = range(start, min(start + batch_size, n))
        frames = torch.from_numpy(dataset.cache.read_frames(camera_key, rows)).to(device)
        text = text_fn(np.arange(rows.start, rows.stop)).to(device) if text_fn is not None else None  # (n, D)
        feats = encoder(frames, text).float().cpu().numpy()
        if out.dtype == np.float16 and np.abs(feats).max(initial=0.0) > 6e4:
            ok = False
        out[start:start + len(rows)] = feats
        bar.update(len(rows))
    return ok


def ensure_features(dataset, encoder: FusedVisionEncoder, cache_dir: str | Path | None = None,
                    batch_size: int = 64, progress: bool = True, device: str | torch.device = "cpu",
                    log=print, embed_text=None, text_model: str | None = None) -> dict[str, np.ndarray]:
    """Per-frame features ``{role: (N, n_tokens, C)}`` for every camera of ``dataset``, built
    on first use. ``encoder`` must be frozen (trainable encoders change their features).

    A FiLM-conditioned encoder encodes each frame with its episode's instruction: it also needs
    ``embed_text(list of str) -> (n, D)`` (e.g. ``Policy.frame_text``'s embedding) and
    ``text_model``, the name of the sentence model (part of the key)."""
    from tqdm import tqdm

    if not encoder.frozen:
        raise ValueError("feature caching needs frozen encoders (model.encoders[*].frozen=true)")
    text_fn = None
    if encoder.needs_text:
        if embed_text is None or text_model is None:
            raise ValueError("a FiLM-conditioned encoder needs each frame's instruction (embed_text and text_model)")
        task_index = np.asarray(dataset.cache.lowdim["task_index"], dtype=np.int64)
        tasks = list(dataset.cache.tasks)

        def text_fn(rows):
            return embed_text([tasks[i] for i in task_index[rows]])
    else:
        text_model = None
    root = Path(cache_dir) if cache_dir is not None else default_feature_dir()
    root.mkdir(parents=True, exist_ok=True)
    encoder = encoder.to(device).eval()
    n = dataset.cache.num_frames
    shape = (n, encoder.n_tokens, encoder.out_dim)
    out: dict[str, np.ndarray] = {}
    for role, camera_key in dataset.cameras.items():
        key, parts = feature_key(dataset, camera_key, encoder, text_model)
        name = f"{dataset.root.resolve().name}-{role}-{key}"
        path = root / f"{name}.npy"
        if not path.is_file():
            with open(root / f".{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.is_file():
                    bar = tqdm(total=n, desc=f"features {role} ({encoder.cache_key()[:40]})", unit="frame",
                               disable=not progress, mininterval=0.5)
                    try:
                        with atomic_file(path) as tmp:
                            arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)
                            if not _encode_all(dataset, camera_key, encoder, arr, batch_size, device, bar, text_fn):
                                del arr  # float16 would overflow: redo in float32
                                bar.reset()
                                arr = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=shape)
                                _encode_all(dataset, camera_key, encoder, arr, batch_size, device, bar, text_fn)
                            arr.flush()
                            del arr
                            atomic_write_text(root / f"{name}.json", json.dumps(parts, indent=1))
                    finally:
                        bar.close()
                    log(f"[features] {role}: {n} frames encoded -> {path}")
        arr = np.load(path, mmap_mode="r")
        if arr.shape != shape:
            raise ValueError(f"{path}: feature array has shape {arr.shape}, expected {shape}; delete it")
        out[role] = np.ascontiguousarray(arr) if arr.nbytes <= IN_MEMORY_BYTES else arr
    return out
