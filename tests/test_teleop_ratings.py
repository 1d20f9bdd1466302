"""Human-rated episodes end to end: an operator marks episodes good / bad in a teleop session, and
training with ``data.rating`` keeps only the episodes of that rating."""

from __future__ import annotations

import pytest

pytest.importorskip("lerobot")
torch = pytest.importorskip("torch")
import robopolicy.data.recorder  # noqa: E402,F401  (lerobot's dataset stack: loaded once, at collection)

from hardware.teleop import ScriptedTeleop  # noqa: E402
from robopolicy.config import ConfigError, build, load_yaml  # noqa: E402
from robopolicy.teleop.ratings import episode_ratings, rated_episodes  # noqa: E402
from robopolicy.teleop.session import TeleopConfig, record_session  # noqa: E402
from robopolicy.train.trainer import TrainConfig, build_dataset, train  # noqa: E402


@pytest.fixture(scope="module")
def rated_dataset(tmp_path_factory):
    """Four operator episodes: good, bad, unmarked, good (the marks from the device's buttons)."""
    root = tmp_path_factory.mktemp("rated") / "ds"
    robot = load_yaml("configs/robots/sim_arm.yaml")
    robot["driver"]["kwargs"].update(cameras=False)
    robot["loop"]["fifo"] = False
    cfg = build(TeleopConfig, {"robot": robot, "teleop": {"type": "scripted", "rate_hz": 30.0,
                                                          "adapter": {"mode": "ee_delta", "step": 0.004}},
                               "dataset": str(root), "task": "move the arm", "fps": 15, "episodes": 4,
                               "episode_s": 20.0, "reset_s": 0.0, "status": False}, "<test>")
    script = []
    for axis, n, marks in (("delta_x", 12, ["success"]), ("delta_y", 10, ["failure"]), ("delta_z", 8, []),
                           ("delta_x", 14, ["success"])):
        script += [{"values": {axis: 1.0}, "repeat": n}, {"values": {}, "events": marks + ["save"]}]
    result = record_session(cfg, device=ScriptedTeleop(script), on_status=lambda line: None)
    assert result.episodes == [0, 1, 2, 3]
    return root


def _train_cfg(dataset, out, **data):
    cfg = {"name": "rated", "out": str(out), "steps": 8, "batch_size": 8, "save_every": 0, "progress": False,
           "data": {"dataset": str(dataset), "features": {"cameras": []}, **data},
           "model": {"head": "chunk_l1", "context_strides": [0], "horizon": 2, "use_state": True,
                     "language": {"enabled": False}, "d_model": 16, "n_heads": 2, "n_layers": 1, "head_layers": 1},
           "optim": {"warmup_steps": 2}}
    return build(TrainConfig, cfg)


def test_the_marks_select_the_episodes(rated_dataset):
    assert episode_ratings(rated_dataset) == [True, False, None, True]
    assert rated_episodes(rated_dataset, "good") == [0, 3]
    assert rated_episodes(rated_dataset, "bad") == [1]
    assert rated_episodes(rated_dataset, "rated") == [0, 1, 3]
    assert rated_episodes(rated_dataset, "unrated") == [2]
    assert rated_episodes(rated_dataset, "good", episodes=[1, 2, 3]) == [3]
    with pytest.raises(ValueError, match="no episode is rated bad .*2 good, 1 bad, 1 unmarked"):
        rated_episodes(rated_dataset, "bad", episodes=[0, 3])
    with pytest.raises(ValueError, match="rating must be one of"):
        rated_episodes(rated_dataset, "great")


def test_training_keeps_only_the_episodes_rated_good(rated_dataset, tmp_path):
    everything = build_dataset(_train_cfg(rated_dataset, tmp_path / "a"), progress=False)
    good = build_dataset(_train_cfg(rated_dataset, tmp_path / "b", rating="good"), progress=False)
    assert everything.episodes == [0, 1, 2, 3] and good.episodes == [0, 3]
    lengths = {e["episode_index"]: e["to"] - e["from"] for e in good.cache.episodes}
    assert len(good) == lengths[0] + lengths[3] < len(everything)
    batch_episodes = {int(good[i]["episode_index"]) for i in range(len(good))}
    assert batch_episodes == {0, 3}  # no frame of the bad or unmarked episodes
    summary = train(_train_cfg(rated_dataset, tmp_path / "run", rating="good"), log=lambda m: None)
    assert summary is not None
    with pytest.raises(ConfigError, match="data.rating: .*no episode is rated bad"):
        build_dataset(_train_cfg(rated_dataset, tmp_path / "c", rating="bad", episodes=[0, 3]), progress=False)
