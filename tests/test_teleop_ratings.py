"""Human-rated episodes end to end: an operator marks episodes good / bad in a teleop session, and
training with ``data.rating`` keeps only the episodes of that rating, or with
``model.condition_on_rating`` learns from all of them with the rating as an input (success
conditioning), asked for ``good`` at inference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

pytest.importorskip("lerobot")
torch = pytest.importorskip("torch")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import robopolicy.data.recorder  # noqa: E402,F401  (lerobot's dataset stack: loaded once, at collection)

from hardware.teleop import ScriptedTeleop  # noqa: E402
from robopolicy.config import ConfigError, build, load_yaml  # noqa: E402
from robopolicy.models.language import LanguageConfig  # noqa: E402
from robopolicy.models.loading import load_policy  # noqa: E402
from robopolicy.models.policy import Policy, PolicyConfig, PolicyError  # noqa: E402
from robopolicy.teleop.ratings import (RATING_INDEX, episode_ratings, rated_episodes, rating_index,  # noqa: E402
                                       row_ratings)
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


def _train_cfg(dataset, out, model=None, **data):
    cfg = {"name": "rated", "out": str(out), "steps": 8, "batch_size": 8, "save_every": 0, "progress": False,
           "data": {"dataset": str(dataset), "features": {"cameras": []}, **data},
           "model": {"head": "chunk_l1", "context_strides": [0], "horizon": 2, "use_state": True,
                     "language": {"enabled": False}, "d_model": 16, "n_heads": 2, "n_layers": 1, "head_layers": 1,
                     **(model or {})},
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


CONDITIONED = {"condition_on_rating": True}


def _state_obs(policy, rows=1):
    rng = np.random.default_rng(0)
    return {"observation.state": rng.normal(size=(rows, policy.config.state_dim)).astype(np.float32)}


def test_each_sample_carries_its_episodes_rating(rated_dataset, tmp_path):
    ds = build_dataset(_train_cfg(rated_dataset, tmp_path / "a", CONDITIONED), progress=False)
    episode_of_row = ds.cache.lowdim["episode_index"]
    rows = row_ratings(rated_dataset, episode_of_row, ds.episodes)
    expected = {0: RATING_INDEX["good"], 1: RATING_INDEX["bad"], 2: RATING_INDEX["unrated"], 3: RATING_INDEX["good"]}
    assert rows.tolist() == [expected[int(e)] for e in episode_of_row]
    assert [rating_index(r) for r in ("good", "bad", "unrated", "", None, True, False)] == [1, 0, 2, 2, 2, 1, 0]
    with pytest.raises(ValueError, match="a rating is one of bad, good, unrated"):
        rating_index("great")


def test_a_rating_conditioned_policy_trains_on_good_and_bad_episodes(rated_dataset, tmp_path):
    result = train(_train_cfg(rated_dataset, tmp_path / "run", CONDITIONED, rating="rated"), log=lambda m: None)
    policy = load_policy(result.final)
    assert policy.config.condition_on_rating and policy.rating_embed is not None
    obs = _state_obs(policy, rows=3)
    default = policy.predict(obs)
    good, bad, unrated = (policy.predict({**obs, "rating": r}) for r in ("good", "bad", "unrated"))
    assert torch.equal(default, good)  # asked for good unless told otherwise
    assert not torch.allclose(good, bad, atol=1e-6) and not torch.allclose(good, unrated, atol=1e-6)
    per_row = policy.predict({**obs, "rating": ["bad", "good", "bad"]})
    assert torch.allclose(per_row[1], good[1])
    assert torch.allclose(per_row[[0, 2]], bad[[0, 2]])
    with pytest.raises(PolicyError, match="observation 'rating': a rating is one of"):
        policy.predict({**obs, "rating": "great"})
    with pytest.raises(PolicyError, match="'rating' holds"):
        policy.predict({**obs, "rating": ["good", "bad"]})


def test_the_rating_token_learns_from_the_ratings_in_the_batch(rated_dataset, tmp_path):
    ds = build_dataset(_train_cfg(rated_dataset, tmp_path / "a", CONDITIONED), progress=False)
    cfg = PolicyConfig(head="chunk_l1", context_strides=[0], horizon=2, use_state=True, cameras=[],
                       language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1, head_layers=1,
                       action_shape=list(np.asarray(ds.stats["action"]["mean"]).shape),
                       state_dim=int(np.asarray(ds.stats["observation.state"]["mean"]).size), condition_on_rating=True)
    policy = Policy(cfg, ds.stats)
    batch = torch.utils.data.default_collate([ds[i] for i in range(0, len(ds), max(1, len(ds) // 8))])
    with pytest.raises(PolicyError, match="the batch needs 'rating'"):
        policy.losses(batch, {"action": 1.0})
    batch["rating"] = torch.tensor([RATING_INDEX["good"], RATING_INDEX["bad"]] * (len(batch["index"]) // 2)
                                   + [RATING_INDEX["good"]] * (len(batch["index"]) % 2))
    policy.losses(batch, {"action": 1.0})["total"].backward()
    grad = policy.rating_embed.weight.grad.abs().sum(dim=1)
    assert grad[RATING_INDEX["good"]] > 0 and grad[RATING_INDEX["bad"]] > 0
    assert grad[RATING_INDEX["unrated"]] == 0  # no unrated sample in this batch


def test_conditioning_without_rated_episodes_is_a_config_error(rated_dataset, tmp_path):
    with pytest.raises(ConfigError, match="model.condition_on_rating: .*none of the 1 episodes trained on is rated"):
        train(_train_cfg(rated_dataset, tmp_path / "run", CONDITIONED, rating="unrated"), log=lambda m: None)
    with pytest.raises(ConfigError, match="model.condition_on_rating: .*none of the 1 episodes"):
        train(_train_cfg(rated_dataset, tmp_path / "run2", CONDITIONED, episodes=[2]), log=lambda m: None)


def test_a_checkpoint_without_the_setting_loads_unchanged(rated_dataset, tmp_path):
    """A checkpoint saved before ``condition_on_rating`` existed (no such key) loads as unconditioned,
    and ignores a rating in the observation."""
    result = train(_train_cfg(rated_dataset, tmp_path / "run"), log=lambda m: None)
    ckpt = result.final
    before = load_policy(ckpt)
    obs = _state_obs(before, rows=2)
    expected = before.predict(obs)
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    assert config["policy"].pop("condition_on_rating") is False
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    weights = ckpt / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        meta = dict(f.metadata())
    saved = json.loads(meta["policy_config"])
    del saved["condition_on_rating"]
    meta["policy_config"] = json.dumps(saved, sort_keys=True)
    save_file(load_file(str(weights)), str(weights), metadata=meta)
    old = load_policy(ckpt)
    assert old.rating_embed is None and not any(k.startswith("rating_embed") for k in old.state_dict())
    assert torch.equal(old.predict(obs), expected)
    assert torch.equal(old.predict({**obs, "rating": "bad"}), expected)


def test_relabelled_frames_train_a_conditioned_policy_as_good_examples():
    # on-policy relabelling (DAgger, HG-DAgger, distillation) builds its own batches: a
    # conditioned policy gets them rated good, the rating its deployment asks for
    from robopolicy.refine import dagger

    values = (("mean", 0), ("std", 1), ("min", -1), ("max", 1), ("q01", -1), ("q99", 1))
    stats = {"action": {k: np.full(2, v, np.float32) for k, v in values},
             "observation.state": {k: np.full(4, v, np.float32) for k, v in values}}
    cfg = PolicyConfig(head="chunk_l1", context_strides=[0], horizon=2, use_state=True, cameras=[],
                       language=LanguageConfig(enabled=False), d_model=16, n_heads=2, n_layers=1, head_layers=1,
                       action_shape=[2], state_dim=4, condition_on_rating=True)
    policy = Policy(cfg, stats)
    obs = {"observation.state": np.zeros(4, np.float32)}
    frames = [{"obs": obs, "future": np.zeros((2, 2), np.float32), "label": np.zeros(2, np.float32)}] * 3
    batch = dagger.make_batch(frames, policy)
    assert batch["rating"].tolist() == [RATING_INDEX["good"]] * 3
    assert torch.isfinite(policy.losses(batch, {"action": 1.0})["total"])
