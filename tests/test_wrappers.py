"""sim_envs.wrappers: reward mode, privileged state and oracle labels (no torch, no robopolicy)."""

from __future__ import annotations

import ast
from pathlib import Path

import gymnasium
import numpy as np
import pytest

import sim_envs  # noqa: F401 - registers the tasks
from sim_envs.wrappers import ENV_STATE, OracleLabels, PrivilegedState, RewardMode, wrap_task


def point(**kw):
    return gymnasium.make("robopolicy/PointReach-v0", disable_env_checker=True, **kw)


def test_sparse_reward_pays_only_the_successful_last_step_and_privileged_state_is_observed():
    env = wrap_task(point(), reward="sparse", privileged=True, oracle=True)
    assert [type(w) for w in (env, env.env, env.env.env)] == [RewardMode, OracleLabels, PrivilegedState]
    assert env.observation_space[ENV_STATE].shape == (2,)
    obs, info = env.reset(seed=3)
    assert obs[ENV_STATE].shape == (2,) and info["oracle_label"].shape == (2,) and info["label_flags"].shape == (4,)
    rewards, done = [], False
    while not done:  # the oracle drives straight at the goal
        obs, r, term, trunc, info = env.step(info["oracle_label"])
        rewards.append(r)
        done = term or trunc
    assert term and info["is_success"] and info["success"] == 1.0
    assert rewards[-1] == 1.0 and not any(rewards[:-1])
    dense = wrap_task(point(), reward="dense")
    dense.reset(seed=3)
    assert dense.step(np.ones(2, np.float32))[1] != 0.0


def test_wrappers_name_what_an_env_lacks():
    with pytest.raises(ValueError, match="reward must be"):
        wrap_task(point(), reward="shaped")
    with pytest.raises(ValueError, match="oracle_chunk"):
        wrap_task(point(), oracle=True, label_chunk=4)
    with pytest.raises(ValueError, match="oracle is off"):
        wrap_task(point(), probe_window=5)


def test_the_wrappers_stay_in_their_layer():
    tree = ast.parse((Path(__file__).resolve().parents[1] / "sim_envs" / "wrappers.py").read_text())
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in modules if m.split(".")[0] in ("torch", "robopolicy", "hardware")}
