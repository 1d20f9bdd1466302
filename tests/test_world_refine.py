"""Refinement inside a world model: λ-returns in imagination, bounded stops, and learning PointReach."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from robopolicy.world.data import Episodes
from robopolicy.world.imagine import WorldRefineConfig, actor_step, imagine
from robopolicy.world.model import WorldModel, WorldModelConfig, WorldModelError

SMALL = WorldModelConfig(latent_dim=16, hidden=[32], num_q=2)


def _episodes() -> Episodes:
    eps = Episodes(4, 2)
    rng = np.random.default_rng(0)
    eps.add(rng.uniform(0, 1, (11, 4)), rng.uniform(-1, 1, (10, 2)), np.zeros(10), np.zeros(10))
    return eps


def test_imagined_returns_have_the_batch_shape_and_train_only_the_actor():
    torch.manual_seed(0)
    model = WorldModel(4, 2, SMALL)
    cfg = WorldRefineConfig(imagine_horizon=4, imagine_batch=8)
    G, stats = imagine(model, model.encode(torch.rand(8, 4)), 4, cfg)
    assert G.shape == (8,) and set(stats) == {"imagined_return", "disagreement", "imagined_success"}
    dynamics = [p.detach().clone() for p in model._dynamics.parameters()]
    pi = [p.detach().clone() for p in model._pi.parameters()]
    actor_step(model, _episodes(), torch.optim.Adam(model._pi.parameters(), lr=1e-2), cfg, np.random.default_rng(0))
    assert all(torch.equal(a, b) for a, b in zip(dynamics, model._dynamics.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(pi, model._pi.parameters()))


def test_nan_in_imagination_stops_with_an_error():
    model = WorldModel(4, 2, SMALL)
    with torch.no_grad():
        model._reward[-1].bias.fill_(float("nan"))
    with pytest.raises(WorldModelError, match="NaN"):
        imagine(model, model.encode(torch.rand(3, 4)), 3, WorldRefineConfig())


def test_refine_with_a_base_is_refused(tmp_path, capsys):
    from robopolicy.cli import main

    code = main(["refine", "--method", "world-model", "--env", "robopolicy/PointReach-v0", "--checkpoint", str(tmp_path),
                 f"out={tmp_path / 'run'}", "iterations=1"])
    assert code == 1 and "not supported yet" in capsys.readouterr().out


def test_refine_runs_dyna_iterations_and_reports(tmp_path, capsys):
    """The loop end to end at a tiny size: real rollouts counted, checkpoint, curve, disagreement reported."""
    from robopolicy.cli import main

    out = tmp_path / "run"
    code = main(["refine", "--method", "world-model", "--env", "robopolicy/PointReach-v0", "--out", str(out),
                 "model.latent_dim=16", "model.hidden=[32]", "model.num_q=2", "iterations=2", "episodes_per_iteration=2",
                 "seed_episodes=2", "pretrain_steps=5", "model_steps=5", "imagine_steps=3", "imagine_batch=16", "batch_size=16", "eval_every=1",
                 "eval_episodes=2", "threads=1"])
    assert code == 0
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert 6 <= metrics["env_steps"] <= 6 * 50 and metrics["disagreement"] >= 0
    assert len((out / "curve.csv").read_text().splitlines()) == 3
    assert WorldModel.load(out / "final").act_dim == 2
    assert "ensemble disagreement" in capsys.readouterr().out


def test_offline_refinement_needs_a_model_and_a_dataset(tmp_path, capsys):
    from robopolicy.cli import main

    code = main(["refine", "--method", "world-model", "--env", "robopolicy/PointReach-v0", "--out", str(tmp_path / "r"),
                 "offline=true", "model.hidden=[32]", "model.latent_dim=16"])
    assert code == 1 and "offline refinement needs" in capsys.readouterr().out


def test_refine_refuses_a_world_model_of_another_env(tmp_path, capsys):
    from robopolicy.cli import main

    WorldModel(6, 2, SMALL).save(tmp_path / "m")
    code = main(["refine", "--method", "world-model", "--env", "robopolicy/PointReach-v0", "--out", str(tmp_path / "r"),
                 f"world={tmp_path / 'm'}", "iterations=1"])
    assert code == 1 and "state 6 / action 2, the env has state 4 / action 2" in capsys.readouterr().out


def test_a_diverged_model_stops_the_refinement_logged_and_bounded(tmp_path, capsys):
    """NaN in the model: the loop stops at once with the reason logged and recorded, no NaN checkpoint is written."""
    from robopolicy.cli import main

    model = WorldModel(4, 2, SMALL)
    with torch.no_grad():
        model._reward[-1].bias.fill_(float("nan"))
    model.save(tmp_path / "m")
    out = tmp_path / "run"
    code = main(["refine", "--method", "world-model", "--env", "robopolicy/PointReach-v0", "--out", str(out),
                 f"world={tmp_path / 'm'}", "seed_episodes=1", "pretrain_steps=2", "iterations=3", "eval_episodes=2",
                 "batch_size=8", "threads=1"])
    assert code == 0
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert "diverged" in metrics["stopped"] and metrics["checkpoint"] is None and not (out / "final").exists()
    assert metrics["env_steps"] <= 50  # only the seed episode ran
    assert "stopped after" in capsys.readouterr().out
