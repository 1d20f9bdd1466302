"""World models: shapes and checkpoints, bad input, and learning PointReach's dynamics from an oracle dataset."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from robopolicy.world.data import Episodes, read_episodes
from robopolicy.world.eval import WorldEvalConfig, auc, evaluate
from robopolicy.world.model import WorldModel, WorldModelConfig, WorldModelError

SMALL = WorldModelConfig(latent_dim=16, hidden=[64, 64], num_q=2)
SMALL_ARGS = ["model.latent_dim=16", "model.hidden=[64,64]", "model.num_q=2", "batch_size=64", "threads=1"]


@pytest.fixture(scope="module")
def point_dataset(tmp_path_factory):
    from robopolicy.data.collect import CollectConfig, collect
    from robopolicy.envs import EnvConfig

    out = tmp_path_factory.mktemp("world") / "point"
    collect(CollectConfig(env=EnvConfig(id="robopolicy/PointReach-v0"), episodes=30, noise=0.5, out=str(out),
                          progress=False), log=lambda m: None)
    return out


@pytest.mark.parametrize("kind", ["tdmpc2", "koopman"])
def test_model_shapes_and_checkpoint_round_trip(tmp_path, kind):
    torch.manual_seed(0)
    model = WorldModel(4, 2, WorldModelConfig(kind=kind, latent_dim=16, hidden=[32], num_q=3),
                       obs_mean=torch.full((4,), 0.5), obs_std=torch.full((4,), 0.2)).eval()
    obs, a = torch.rand(5, 4), torch.rand(5, 3, 2) * 2 - 1
    z = model.encode(obs)
    assert z.shape == (5, 16)
    if kind == "tdmpc2":  # SimNorm: groups of simnorm_dim entries sum to one
        assert torch.allclose(z.reshape(5, -1, 8).sum(-1), torch.ones(5, 2))
    zs = model.rollout(z, a)
    assert zs.shape == (5, 4, 16)
    assert model.reward(z, a[:, 0]).shape == model.success(z).shape == (5,)
    assert model.Q(z, a[:, 0], "all").shape == (3, 5) and model.Q(z, a[:, 0]).shape == (5,)
    act, logp = model.pi(z)
    assert act.shape == (5, 2) and act.abs().max() <= 1 and logp.shape == (5,)
    model.save(tmp_path / "ckpt")
    loaded = WorldModel.load(tmp_path / "ckpt")
    assert torch.equal(loaded.obs_mean, model.obs_mean)  # normalisation travels inside the weights
    assert torch.allclose(loaded.rollout(loaded.encode(obs), a), zs)
    with pytest.raises(WorldModelError, match="not a world-model checkpoint"):
        WorldModel.load(tmp_path)


def test_episodes_windows_mask_past_the_end():
    eps = Episodes(1, 1)
    eps.add(np.arange(3, dtype=np.float32)[:, None], np.ones((3, 1)), [0, 0, 1], [0, 0, 1])  # last next obs unknown
    b = eps.sample(64, horizon=4, rng=np.random.default_rng(0))
    assert b["obs"].shape == (64, 5, 1) and b["action"].shape == (64, 4, 1)
    starts = b["obs"][:, 0, 0].astype(int)
    np.testing.assert_array_equal(b["valid"].sum(1), 3 - starts)
    np.testing.assert_array_equal(b["next_known"].sum(1), 2 - starts)
    np.testing.assert_array_equal(b["success"].sum(1), 1)  # every window reaches the last (successful) step


def test_auc():
    assert auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc([0.5, 0.5], [0, 1]) == 0.5
    assert auc([0.3, 0.4], [1, 1]) is None


def test_dataset_without_needed_keys_is_refused(point_dataset, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(point_dataset, bad)
    info = json.loads((bad / "meta" / "info.json").read_text())
    for key in ("next.reward", "next.success", "next.done"):
        info["features"].pop(key)
    (bad / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(WorldModelError, match=r"lacks next\.reward .*next\.success or next\.done"):
        read_episodes(bad)
    from robopolicy.cli import main

    assert main(["world", "train", f"dataset={bad}", f"out={tmp_path / 'run'}", *SMALL_ARGS]) == 1


def test_world_model_learns_point_reach_and_eval_reports(point_dataset, tmp_path, capsys):
    """Trained on 30 noisy oracle episodes, the model predicts the simulator's states from the
    same actions far better than an untrained one, and ranks success steps above the others."""
    from robopolicy.cli import main

    run = tmp_path / "run"
    assert main(["world", "train", f"dataset={point_dataset}", f"out={run}", "steps=400", "log_every=400",
                 *SMALL_ARGS]) == 0
    assert (run / "final" / "model.safetensors").is_file() and (run / "summary.json").is_file()
    WorldModel(4, 2, SMALL).save(tmp_path / "untrained")
    common = dict(episodes=12, horizon=16, threads=1)
    before = evaluate(WorldEvalConfig(checkpoint=str(tmp_path / "untrained"), out=str(tmp_path / "e0"), **common))
    assert main(["world", "eval", "--checkpoint", str(run / "final"), "--env", "robopolicy/PointReach-v0",
                 "--out", str(tmp_path / "e1"), "episodes=12", "horizon=16", "threads=1"]) == 0
    after = json.loads((tmp_path / "e1" / "summary.json").read_text())["metrics"]
    assert after["state_error_k1"] < 0.5 * before["state_error_k1"], (before, after)
    assert after["state_error_k4"] < before["state_error_k4"]
    assert after["success_auc"] is not None and after["success_auc"] > 0.6, after
    assert after["latent_spread"] > 0
    assert (tmp_path / "e1" / "prediction.png").stat().st_size > 1000
    assert "state error k=1" in capsys.readouterr().out


def test_eval_refuses_a_model_of_another_env(tmp_path):
    WorldModel(6, 2, SMALL).save(tmp_path / "m")
    with pytest.raises(WorldModelError, match="state 6 / action 2, the env has state 4 / action 2"):
        evaluate(WorldEvalConfig(checkpoint=str(tmp_path / "m"), out=str(tmp_path / "e"), episodes=1))


def test_weights_that_do_not_fit_their_config_are_refused(tmp_path):
    WorldModel(4, 2, SMALL).save(tmp_path / "m")
    config = (tmp_path / "m" / "config.yaml").read_text()
    (tmp_path / "m" / "config.yaml").write_text(config.replace("num_bins: 101", "num_bins: 51"))
    with pytest.raises(WorldModelError, match="weights do not fit the model"):
        WorldModel.load(tmp_path / "m")
