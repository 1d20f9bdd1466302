"""The one chunk executor (hardware.control.chunking): queue, temporal ensembling, crossfade,
batched over envs; the real-time scheduler takes its blend weights from the same module."""

from __future__ import annotations

import numpy as np
import pytest

from hardware.control import ActionScheduler, Chunk
from hardware.control.chunking import ChunkExecutor, advance_waypoints, crossfade_weights, ensemble_weights
from sim_envs.person_follow.waypoints import arc_waypoints


def one(rows_chunk) -> np.ndarray:
    return np.asarray(rows_chunk, dtype=np.float32)[None]


def test_chunk_mode_runs_steps_per_chunk_then_asks_again():
    ex = ChunkExecutor("chunk", steps_per_chunk=2, n_envs=1)
    assert ex.needs().tolist() == [True]
    ex.add([0], np.arange(8, dtype=np.float32).reshape(1, 4, 2))
    assert np.allclose(ex.next(), [[0, 1]]) and ex.executed().tolist() == [1]
    assert not ex.needs()[0]
    assert np.allclose(ex.next(), [[2, 3]])
    assert ex.needs()[0]
    with pytest.raises(RuntimeError):
        ex.next()
    whole = ChunkExecutor("chunk", n_envs=1)
    whole.add([0], np.zeros((1, 3, 1)))
    for i in range(3):
        assert not whole.needs()[0]
        whole.next()
    assert whole.needs()[0]


def test_rows_are_independent_and_reset_per_row():
    ex = ChunkExecutor("chunk", steps_per_chunk=3, n_envs=3)
    ex.add([0, 1, 2], np.arange(3)[:, None, None] * 10.0 + np.arange(4)[None, :, None])
    assert ex.next()[:, 0].tolist() == [0, 10, 20]
    ex.reset([1])
    assert ex.needs().tolist() == [False, True, False]
    ex.add([1], np.full((1, 4, 1), 7.0))
    assert ex.next()[:, 0].tolist() == [1, 7, 21]
    assert ex.next(rows=[2], peek=True)[:, 0].tolist() == [22] and ex.next([2])[:, 0].tolist() == [22]
    assert ex.resize(2) and ex.needs().tolist() == [True, True] and not ex.resize(2)


def test_temporal_ensembling_weights_older_chunks_by_exp_decay():
    k = 0.5
    ex = ChunkExecutor("ensemble", ensemble_coeff=k, n_envs=1)
    ex.add([0], one([[1.0], [2.0], [3.0]]))
    assert ex.next()[0, 0] == pytest.approx(1.0)
    assert ex.needs()[0]
    ex.add([0], one([[10.0], [20.0], [30.0]]))
    w = np.exp(-k * np.arange(2))
    assert ex.next()[0, 0] == pytest.approx((w[0] * 2.0 + w[1] * 10.0) / w.sum(), rel=1e-5)
    ex.add([0], one([[100.0], [200.0], [300.0]]))
    w = np.exp(-k * np.arange(3))
    assert ex.next()[0, 0] == pytest.approx((w[0] * 3.0 + w[1] * 20.0 + w[2] * 100.0) / w.sum(), rel=1e-5)
    # the first chunk is used up: only the two later ones cover the next step
    ex.add([0], one([[0.0], [0.0], [0.0]]))
    assert ex.next()[0, 0] == pytest.approx((w[0] * 30.0 + w[1] * 200.0 + w[2] * 0.0) / w.sum(), rel=1e-5)
    plain = ChunkExecutor("ensemble", ensemble_coeff=0.0, n_envs=1)
    plain.add([0], one([[0.0], [4.0]]))
    plain.next()
    plain.add([0], one([[2.0], [9.0]]))
    assert plain.next()[0, 0] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="ensembling"):
        ChunkExecutor("ensemble", kind="waypoints")


def test_crossfade_hands_over_from_the_old_chunk_to_the_new_one():
    ex = ChunkExecutor("crossfade", steps_per_chunk=2, crossfade_steps=3, n_envs=1)
    ex.add([0], one(np.zeros((6, 1))))
    assert ex.next()[0, 0] == 0 and not ex.needs()[0]
    ex.next()
    assert ex.needs()[0]
    ex.add([0], one(np.full((6, 1), 8.0)))
    # the new chunk's weight ramps (age + 1) / (crossfade_steps + 1): 1/4, 2/4, 3/4, then all of it
    got = [float(ex.next()[0, 0]) for _ in range(2)]
    assert got == pytest.approx([2.0, 4.0])
    ex.add([0], one(np.full((6, 1), 8.0)))
    # the oldest keeps what neither newer chunk has taken: (1 - 1/4) * (1 - 3/4) of the step
    assert ex.next()[0, 0] == pytest.approx(8.0 * (1 - 0.75 * 0.25))
    instant = ChunkExecutor("crossfade", steps_per_chunk=1, crossfade_steps=0, n_envs=1)
    instant.add([0], one([[1.0], [1.0]]))
    instant.next()
    instant.add([0], one([[5.0], [5.0]]))
    assert instant.next()[0, 0] == pytest.approx(5.0)


def test_blend_weights_are_the_schedulers():
    assert ensemble_weights(3, 0.0).tolist() == pytest.approx([1 / 3] * 3)
    assert ensemble_weights(2, 1.0)[0] > ensemble_weights(2, 1.0)[1]
    assert crossfade_weights([0.3, 0.25, 1.0]) == pytest.approx([0.0, 0.0, 1.0])
    assert crossfade_weights([1.0, 0.5]) == pytest.approx([0.5, 0.5])
    assert sum(crossfade_weights([1.0, 0.2, 0.7])) == pytest.approx(1.0)
    # the real-time scheduler: two chunks in flight at a step boundary blend by the same weights
    s = ActionScheduler("ensemble", ensemble_k=0.7)
    s.add(Chunk(np.zeros((5, 1)), t_obs=0.0, dt=0.1), now=0.0)
    s.add(Chunk(np.full((5, 1), 4.0), t_obs=0.1, dt=0.1), now=0.1)
    assert s.command_at(0.2)[0] == pytest.approx(ensemble_weights(2, 0.7)[1] * 4.0)
    r = ActionScheduler("rtc", crossfade=0.2)
    r.add(Chunk(np.zeros((5, 1)), t_obs=0.0, dt=0.1), now=0.0)
    r.add(Chunk(np.full((5, 1), 4.0), t_obs=0.1, dt=0.1), now=0.1)
    assert r.command_at(0.15)[0] == pytest.approx(crossfade_weights([1.0, 0.25])[1] * 4.0)


def test_held_waypoints_are_shifted_into_the_next_robot_frame():
    arc = arc_waypoints(0.8, 0.6, 0.1, 8)
    # a constant-twist arc seen one step later is the same arc
    assert np.allclose(advance_waypoints(arc), arc, atol=1e-5)
    straight = arc_waypoints(1.0, 0.0, 0.1, 4)
    assert np.allclose(advance_waypoints(straight)[:, 0], [0.1, 0.2, 0.3, 0.4], atol=1e-6)
    ex = ChunkExecutor("chunk", steps_per_chunk=3, kind="waypoints", n_envs=1)
    ex.add([0], arc[None])
    for _ in range(3):
        assert np.allclose(ex.next()[0], arc, atol=1e-5)
    assert ex.needs()[0]
