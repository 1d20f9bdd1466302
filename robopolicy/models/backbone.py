"""Transformer that fuses vision, language and proprio tokens into one memory for the heads."""

from __future__ import annotations

import torch
from torch import nn


class FusionTransformer(nn.Module):
    """Pre-norm transformer encoder over ``[vision tokens, language token, proprio token]``.

    ``forward(vision (B, Nv, d) | None, language (B, L, d) | None, proprio (B, P, d) | None,
    vision_pad (B, Nv) bool | None, language_pad (B, L) bool | None)`` → memory ``(B, N, d)`` and
    its key padding mask ``(B, N)`` (L = 1 for a pooled instruction, more for its tokens; P = 1
    for the joint state, 2 with the low-dimensional scene state). ``vision`` is ``None`` for a
    state-only policy; at least one of the three must be given.
    Each modality gets a learned type embedding so the tokens stay distinguishable.
    """

    def __init__(self, d_model: int = 192, n_heads: int = 4, n_layers: int = 3, ff_mult: int = 4,
                 dropout: float = 0.1):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, n_heads, ff_mult * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.type_embed = nn.Parameter(torch.randn(3, d_model) * 0.02)  # vision, language, proprio

    def forward(self, vision: torch.Tensor | None, language: torch.Tensor | None = None,
                proprio: torch.Tensor | None = None, vision_pad: torch.Tensor | None = None,
                language_pad: torch.Tensor | None = None):
        parts, pads = [], []
        given = [t for t in (vision, language, proprio) if t is not None]
        if not given:
            raise ValueError("FusionTransformer: no tokens (vision, language and proprio are all None)")
        b = given[0].shape[0]
        for i, tok, tok_pad in ((0, vision, vision_pad), (1, language, language_pad), (2, proprio, None)):
            if tok is not None:
                parts.append(tok + self.type_embed[i])
                pads.append(tok_pad.to(tok.device) if tok_pad is not None
                            else tok.new_zeros(b, tok.shape[1], dtype=torch.bool))
        x = torch.cat(parts, dim=1)
        pad = torch.cat(pads, dim=1)
        # A padded context frame repeats the first frame: masking it keeps the memory honest.
        memory = self.norm(self.encoder(x, src_key_padding_mask=pad if pad.any() else None))
        return memory, pad
