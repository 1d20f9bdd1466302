"""Random-shift augmentation: frames move together, boxes move with them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from robopolicy.train.augment import random_shift  # noqa: E402


def test_random_shift_moves_frames_and_boxes_together():
    b, t, h, w, pad = 6, 3, 20, 24, 3
    imgs = torch.zeros(b, t, 3, h, w, dtype=torch.uint8)
    imgs[:, :, :, 8, 10] = 255  # one bright pixel at (x=10, y=8) in every frame
    box = torch.tensor([[9.0, 7.0, 12.0, 10.0]]).repeat(b, 1)
    batch = {"observation.images.front": imgs, "observation.images.wrist": imgs.clone(),
             "label.target_box": box, "task": ["x"] * b}
    out = random_shift(batch, pad, torch.Generator().manual_seed(0))
    assert out["observation.images.front"].shape == imgs.shape and out["observation.images.front"].dtype == torch.uint8
    assert out["task"] is batch["task"] and torch.equal(batch["observation.images.front"], imgs)  # input untouched
    moved = set()
    for i in range(b):
        front = out["observation.images.front"][i]
        ys, xs = torch.nonzero(front[0, 0] == 255, as_tuple=True)
        assert len(xs) == 1
        dx, dy = int(xs[0]) - 10, int(ys[0]) - 8
        assert abs(dx) <= pad and abs(dy) <= pad
        moved.add((dx, dy))
        # every context frame and camera of a sample moves by the same offset
        assert all(torch.equal(front[k], front[0]) for k in range(t))
        assert torch.equal(out["observation.images.wrist"][i], front)
        assert torch.allclose(out["label.target_box"][i], torch.tensor([9.0 + dx, 7.0 + dy, 12.0 + dx, 10.0 + dy]))
    assert len(moved) > 1  # offsets differ between samples
    assert random_shift(batch, 0)["observation.images.front"] is imgs
