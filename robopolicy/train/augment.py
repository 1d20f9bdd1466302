"""Image augmentation for trainable encoders: random shifts (DrQ / robomimic style).

    batch = random_shift(batch, pad=4, generator=g)

Each sample's frames are padded by ``pad`` pixels (edge replication) and cropped back to their
size at one random offset, the same offset for every context frame and camera of that sample,
so motion between context frames is untouched. Box labels (``label.target_box``, pixels
``x0 y0 x1 y1``) move with the image. Frozen encoders train on cached features and are never
augmented: their features are computed once per frame.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

IMAGE_PREFIX = "observation.images."
BOX_LABEL = "label.target_box"


def random_shift(batch: Mapping[str, Any], pad: int, generator: torch.Generator | None = None) -> dict[str, Any]:
    """A copy of ``batch`` whose images ``(B, T, 3, H, W)`` (uint8 or float) are shifted by up to
    ``pad`` pixels per sample; ``label.target_box (B, 4)`` shifts with them (clipped to the frame)."""
    out = dict(batch)
    keys = [k for k in batch if k.startswith(IMAGE_PREFIX)]
    if pad <= 0 or not keys:
        return out
    b = batch[keys[0]].shape[0]
    offsets = torch.randint(0, 2 * pad + 1, (b, 2), generator=generator)  # (dx, dy) in [0, 2 pad]
    for key in keys:
        imgs = batch[key]
        _, t, c, h, w = imgs.shape
        x = imgs.reshape(b, t * c, h, w)
        dtype = x.dtype
        x = F.pad(x.float(), (pad, pad, pad, pad), mode="replicate")
        crops = torch.stack([x[i, :, dy:dy + h, dx:dx + w] for i, (dx, dy) in enumerate(offsets.tolist())])
        out[key] = crops.to(dtype).reshape(b, t, c, h, w)
    if BOX_LABEL in batch:
        h, w = batch[keys[0]].shape[-2:]
        # the crop at offset o shows the padded frame from o on: content moves by pad - o
        box = batch[BOX_LABEL].float() + (pad - offsets).float().repeat(1, 2)
        out[BOX_LABEL] = torch.minimum(box.clamp(min=0), box.new_tensor([w, h, w, h]))
    return out
