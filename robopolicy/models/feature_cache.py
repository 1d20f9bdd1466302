"""Frozen-encoder features computed once per dataset frame and reused by every training step.

    feats = ensure_features(dataset, policy.vision)     # {camera role: (N, n, C) float16 array}

With frozen encoders a training step only needs each context frame's encoder output, which never
changes: encoding it once (here, with a progress bar) instead of ``T`` times per sample per
epoch is what makes training fast on a CPU. Row ``i`` of a feature array is global dataset row
``i`` (the ``index`` column), so context and chunk lookups stay plain integer indexing.

A feature file is keyed by the training cache entry (which carries the dataset's content key,
``robopolicy.data.cache.content_key``), the camera, and one encoder's identity (timm name, image
size, stage, grid and a digest of its weights): a changed dataset or encoder gets a new file, so
stale features are never read. A fused pair keeps one file per member, so the two never collide
and a member shared with another recipe (Lite0 alone, then Lite0 beside Lite2) is encoded once.
Files are written under a temporary name and renamed when complete, under a file lock (one
builder when several trainers start at once).

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
from robopolicy.models.encoders import FusedVisionEncoder, VisionEncoder
from robopolicy.utils.files import atomic_file, atomic_write_text

FEATURE_FORMAT = 2  # 2: one file per frozen member of a fused encoder
IN_MEMORY_BYTES = 4 << 30  # smaller feature files are read into RAM; larger ones stay memory-mapped


def default_feature_dir() -> Path:
    """``<training cache dir>/../features`` (``~/.cache/robopolicy/features`` by default)."""
    return default_cache_dir().parent / "features"


def feature_key(dataset, camera_key: str, member_key: str, text_model: str | None = None) -> tuple[str, dict]:
    """Hex key and its ingredients for one camera of ``dataset`` (a ``TrainingDataset``) and one
    encoder (``member_key``: :meth:`VisionEncoder.cache_key`); ``text_model``: the sentence model
    whose embeddings condition a FiLM encoder."""
    import timm

    parts = {"format": FEATURE_FORMAT, "cache_entry": dataset.entry.name, "camera": camera_key,
             "encoder": member_key, "timm": timm.__version__}
    if text_model is not None:
        parts["text_model"] = text_model
    digest = hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=10).hexdigest()
    return digest, parts


@torch.inference_mode()
def _encode_all(dataset, camera_key: str, encoder: VisionEncoder, out: np.ndarray, batch_size: int,
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


def _text_fn(dataset, embed_text):
    """Row indices → the embedding ``(n, D)`` of each row's episode instruction."""
    task_index = np.asarray(dataset.cache.lowdim["task_index"], dtype=np.int64)
    tasks = list(dataset.cache.tasks)
    return lambda rows: embed_text([tasks[i] for i in task_index[rows]])


def _build(path: Path, parts: dict, dataset, camera_key: str, encoder: VisionEncoder, shape: tuple,
           batch_size: int, device, text_fn, progress: bool, desc: str) -> None:
    """Encode every frame into ``path`` (float16, or float32 when float16 would overflow) and
    write the key's ingredients beside it; atomic, so a killed build leaves no file."""
    from tqdm import tqdm

    bar = tqdm(total=shape[0], desc=desc, unit="frame", disable=not progress, mininterval=0.5)
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
            atomic_write_text(path.with_suffix(".json"), json.dumps(parts, indent=1))
    finally:
        bar.close()


def member_features(dataset, encoder: VisionEncoder, root: Path, batch_size: int = 64,
                    progress: bool = True, device: str | torch.device = "cpu", log=print, embed_text=None,
                    text_model: str | None = None) -> dict[str, np.ndarray]:
    """One frozen encoder's per-frame features ``{role: (N, n_tokens, C)}`` for every camera of
    ``dataset``, read from ``root`` or built there on first use (under a file lock: one builder
    when several trainers start at once). The file is keyed by this encoder alone, so each
    member of a pair has its own file, and a member shared by two recipes is encoded once."""
    if not encoder.cfg.frozen:
        raise ValueError(f"feature caching needs a frozen encoder ({encoder.describe()} is trainable)")
    text_fn = None
    if encoder.needs_text:
        if embed_text is None or text_model is None:
            raise ValueError("a FiLM-conditioned encoder needs each frame's instruction (embed_text and text_model)")
        text_fn = _text_fn(dataset, embed_text)
    else:
        text_model = None
    encoder = encoder.to(device).eval()
    member_key = encoder.cache_key()
    shape = (dataset.cache.num_frames, encoder.n_tokens, encoder.out_dim)
    out: dict[str, np.ndarray] = {}
    for role, camera_key in dataset.cameras.items():
        key, parts = feature_key(dataset, camera_key, member_key, text_model)
        name = f"{dataset.root.resolve().name}-{role}-{key}"
        path = root / f"{name}.npy"
        if not path.is_file():
            with open(root / f".{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.is_file():
                    _build(path, parts, dataset, camera_key, encoder, shape, batch_size, device, text_fn, progress,
                           desc=f"features {role} ({member_key[:40]})")
                    log(f"[features] {role}, {encoder.describe()}: {shape[0]} frames encoded -> {path}")
        arr = np.load(path, mmap_mode="r")
        if arr.shape != shape:
            raise ValueError(f"{path}: feature array has shape {arr.shape}, expected {shape}; delete it")
        out[role] = np.ascontiguousarray(arr) if arr.nbytes <= IN_MEMORY_BYTES else arr
    return out


def ensure_features(dataset, encoder: FusedVisionEncoder, cache_dir: str | Path | None = None,
                    batch_size: int = 64, progress: bool = True, device: str | torch.device = "cpu",
                    log=print, embed_text=None, text_model: str | None = None) -> dict[str, np.ndarray]:
    """Per-frame features ``{role: (N, n_tokens, sum of C)}`` of the fused encoder for every camera
    of ``dataset``: each member's cached features (:func:`member_features`), concatenated along
    the channels in the members' order, as :meth:`FusedVisionEncoder.forward` concatenates them.
    Every member must be frozen (trainable encoders change their features).

    A FiLM-conditioned encoder encodes each frame with its episode's instruction: it also needs
    ``embed_text(list of str) -> (n, D)`` (e.g. ``Policy.frame_text``'s embedding) and
    ``text_model``, the name of the sentence model (part of the key)."""
    if not encoder.frozen:
        trainable = [e.describe() for e in encoder.encoders if not e.cfg.frozen]
        raise ValueError(f"feature caching needs frozen encoders ({', '.join(trainable)} trainable: "
                         "model.encoders[*].frozen=true)")
    root = Path(cache_dir) if cache_dir is not None else default_feature_dir()
    root.mkdir(parents=True, exist_ok=True)
    members = [member_features(dataset, e, root, batch_size, progress, device, log, embed_text, text_model)
               for e in encoder.encoders]
    if len(members) == 1:
        return members[0]
    # concatenate promotes: a float16 member beside a float32 one gives float32
    return {role: np.concatenate([m[role] for m in members], axis=-1) for role in dataset.cameras}
