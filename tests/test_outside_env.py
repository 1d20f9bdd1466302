"""A user's own data and env, through the CLI alone: a LeRobot dataset recorded in gymnasium's
``Pusher-v5`` (23-d state, 7-d action, no camera, nothing of ours) trains with a shipped recipe
and overrides, and the policy is evaluated on ``Pusher-v5`` through ``configs/eval/pusher.yaml``.
The mistakes such a user meets first get errors that name the setting to change."""

import json
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from robopolicy.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STATE_RECIPE = str(ROOT / "configs" / "train" / "arm" / "state_chunk.yaml")
CAMERA_RECIPE = str(ROOT / "configs" / "train" / "arm" / "reach_cam.yaml")
PUSHER_EVAL = str(ROOT / "configs" / "eval" / "pusher.yaml")


@pytest.fixture(scope="module")
def pusher_dataset(tmp_path_factory) -> Path:
    """3 episodes x 25 steps of Pusher-v5 under a noisy scripted action, written with lerobot's API."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path_factory.mktemp("outside") / "pusher"
    features = {"observation.state": {"dtype": "float32", "shape": (23,), "names": None},
                "action": {"dtype": "float32", "shape": (7,), "names": None}}
    ds = LeRobotDataset.create("someone/pusher", fps=20, features=features, root=root, use_videos=False)
    env = gymnasium.make("Pusher-v5")
    rng = np.random.default_rng(0)
    for episode in range(3):
        obs, _ = env.reset(seed=episode)
        for _ in range(25):
            action = np.clip(0.5 * np.sin(obs[:7]) + rng.normal(0, 0.3, 7), -2, 2).astype(np.float32)
            ds.add_frame({"observation.state": obs.astype(np.float32), "action": action,
                          "task": "push the object to the goal"})
            obs, *_ = env.step(action)
        ds.save_episode()
    ds.finalize()
    env.close()
    return root


def _train_args(dataset: Path, tmp: Path, name: str, *extra: str) -> list[str]:
    return ["train", f"--data.dataset={dataset}", "data.features.action=action", f"--out={tmp / name}",
            f"data.cache_dir={tmp / 'cache'}", "steps=12", "batch_size=8", "save_every=0", "log_every=4",
            "threads=1", "--no-progress", *extra]


def test_mistakes_an_outside_user_meets_name_the_setting(pusher_dataset, tmp_path, capsys):
    # an arm camera recipe over another dataset: its loss.locate still asks for the locate head
    base = _train_args(pusher_dataset, tmp_path, "a", "--config", CAMERA_RECIPE, "data.features.cameras=[]",
                       "data.features.labels=[]", "model.aux_heads=[]")
    assert main(base) == 1
    said = capsys.readouterr().out
    assert "loss.locate" in said and "set loss.locate: 0" in said and "label.goal_pos" not in said
    # relative action dims beyond the 7-d action: a config error before any statistics are computed
    assert main([*base, "loss.locate=0", "model.relative_action=[0,1,2,3,4,5,6,7]"]) == 1
    said = capsys.readouterr().out
    assert "model.relative_action" in said and "below 7" in said
    # the state recipe's scene state is a setting to change, not a missing "label"
    assert main(_train_args(pusher_dataset, tmp_path, "b", "--config", STATE_RECIPE)) == 1
    said = capsys.readouterr().out
    assert "data.features.env_state asks for the feature 'observation.environment_state'" in said
    assert "label" not in said.split("(features:")[0]
    # a plain id that is not registered: use module:EnvId
    assert main(["eval", "--checkpoint", str(tmp_path), "--env", "outside/Nothing-v0", "--no-progress"]) == 2
    assert "module:EnvId" in capsys.readouterr().err


def test_train_and_evaluate_on_an_outside_dataset_and_env_through_the_cli(pusher_dataset, tmp_path, capsys):
    assert main(["train", "--config", STATE_RECIPE, "--print-config", "data.features.env_state=null"]) == 0
    assert "env_state: null" in capsys.readouterr().out

    run = tmp_path / "run"
    args = _train_args(pusher_dataset, tmp_path, "run", "--config", STATE_RECIPE, "data.features.env_state=null",
                       "model.horizon=4", "model.d_model=32", "model.n_layers=1", "model.head_layers=1")
    assert main(args) == 0
    policy_cfg = (run / "final" / "config.yaml").read_text()
    assert "state_dim: 23" in policy_cfg and "- 7" in policy_cfg  # the outside sizes, from the dataset

    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(run / "final"), "--config", PUSHER_EVAL, "--env=gymnasium:Pusher-v5",
                 "--episodes=2", f"--out={out}", "max_steps=30", "--no-progress"]) == 0
    report = json.loads((out / "eval.json").read_text())
    episodes = [e for split in report["splits"] for e in split["episodes"]]
    assert len(episodes) == 2 and all(e["steps"] == 30 for e in episodes)
