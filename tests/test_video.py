import numpy as np
import pytest

from robopolicy.utils.video import hstack_frames, read_mp4, write_mp4


def test_write_and_read_back(tmp_path):
    frames = [np.full((31, 40, 3), i * 20, np.uint8) for i in range(8)]
    path = write_mp4(tmp_path / "v.mp4", frames, fps=10)
    video = read_mp4(path)
    assert video.shape == (8, 32, 40, 3)  # odd height padded to even
    assert abs(int(video[5, 10, 10, 0]) - 100) < 8
    assert not list(tmp_path.glob(".*tmp*"))


def test_bad_frames_leave_nothing(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_mp4(tmp_path / "v.mp4", [np.zeros((8, 8, 3), np.float32)], fps=10)
    with pytest.raises(ValueError, match="no frames"):
        write_mp4(tmp_path / "w.mp4", [], fps=10)
    assert list(tmp_path.iterdir()) == []


def test_hstack_resizes_to_tallest():
    out = hstack_frames([np.zeros((64, 64, 3), np.uint8), np.ones((32, 48, 3), np.uint8)])
    assert out.shape == (64, 64 + 96, 3)
