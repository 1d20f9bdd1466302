"""Domain randomisation (sim_envs.randomization, EnvConfig.randomize): the look of a task changes
with its seed when on, nothing changes when off, and the task itself is the same either way."""

from __future__ import annotations

import numpy as np
import pytest

from robopolicy.config import ConfigError, build
from robopolicy.envs import EnvConfig, make_env
from sim_envs.randomization import DomainRandomization, RandomizeSettings
from sim_envs.rollout import run_oracle_episode

FULL = {"lighting": True, "textures": True, "camera_jitter": True, "distractors": 3}
CAMERAS = ("observation.images.front", "observation.images.wrist")


def first_frame(randomize: dict, seed: int = 5, env_id: str = "robopolicy/ArmPushCube-v0"):
    env = make_env(EnvConfig(env_id, {"image_size": 48}, randomize))
    try:
        return env.reset(seed=seed)
    finally:
        env.close()


def test_images_differ_across_randomisation_seeds_and_repeat_for_the_same_seed():
    a, _ = first_frame(dict(FULL, seed=0))
    b, _ = first_frame(dict(FULL, seed=1))
    again, _ = first_frame(dict(FULL, seed=0))
    for key in CAMERAS:
        assert not np.array_equal(a[key], b[key]), key
        assert np.array_equal(a[key], again[key]), key
    other_layout, _ = first_frame(dict(FULL, seed=0), seed=6)  # the episode seed draws the look too
    assert not np.array_equal(a[CAMERAS[0]], other_layout[CAMERAS[0]])


def test_off_leaves_every_frame_as_the_plain_task_renders_it():
    plain, _ = first_frame({})
    for off in ({"lighting": False, "distractors": 0, "seed": 3}, {"seed": 1}):
        obs, _ = first_frame(off)
        for key in CAMERAS:
            assert np.array_equal(plain[key], obs[key]), (off, key)


@pytest.mark.parametrize("setting", ["lighting", "textures", "camera_jitter", "distractors"])
def test_each_setting_changes_the_frames_alone(setting):
    plain, _ = first_frame({})
    obs, _ = first_frame({setting: 2 if setting == "distractors" else True})
    assert any(not np.array_equal(plain[k], obs[k]) for k in CAMERAS)


def test_the_task_is_the_same_with_randomisation_on():
    """Layout, instruction, joint state and the physics of the same actions do not change."""
    envs = [make_env(EnvConfig("robopolicy/ArmPickPlace-v0", {"image_size": 32}, r)) for r in ({}, dict(FULL, seed=4))]
    try:
        (o1, i1), (o2, i2) = (e.reset(seed=11) for e in envs)
        assert o1["task"] == o2["task"]
        rng = np.random.default_rng(0)
        for _ in range(15):
            action = o1["observation.state"] + rng.normal(0, 0.1, 6).astype(np.float32)
            o1, r1, *_ , i1 = envs[0].step(action)
            o2, r2, *_ , i2 = envs[1].step(action)
        np.testing.assert_array_equal(o1["observation.state"], o2["observation.state"])
        np.testing.assert_array_equal(i1["cube_pos"], i2["cube_pos"])
        assert r1 == r2
        # the instruction's colours are the objects' own: the task's geoms keep them
        base = [e.unwrapped for e in envs]
        np.testing.assert_array_equal(base[0].model.geom_rgba[base[0]._cube_geom], base[1].model.geom_rgba[base[1]._cube_geom])
    finally:
        for e in envs:
            e.close()


def test_the_oracle_still_succeeds_under_randomisation():
    env = make_env(EnvConfig("robopolicy/ArmPushCube-v0", {"use_cameras": False}, dict(FULL, seed=2)))
    try:
        results = [run_oracle_episode(env, seed) for seed in (0, 1)]
    finally:
        env.close()
    assert all(r.success for r in results), [r.episode_metrics for r in results]


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="randomize: unknown key 'fog'"):
        RandomizeSettings.from_mapping({"fog": True})
    with pytest.raises(ValueError, match="randomize.lighting must be true or false"):
        RandomizeSettings.from_mapping({"lighting": "yes"})
    with pytest.raises(ConfigError, match="distractors: .* has 4 distractor geoms, 9 asked for"):
        make_env(EnvConfig("robopolicy/ArmReach-v0", {"use_cameras": False}, {"distractors": 9}))
    cfg = build(EnvConfig, {"id": "robopolicy/ArmReach-v0", "randomize": {"textures": True}})
    env = make_env(cfg)
    try:
        assert isinstance(env, DomainRandomization)
    finally:
        env.close()


def test_person_follow_is_randomised_from_its_first_frame_and_keeps_its_task():
    def first(randomize):
        env = make_env(EnvConfig("robopolicy/PersonFollow-v0", {"split": "dt", "image_size": 48}, randomize))
        try:
            return env.reset(seed=3)
        finally:
            env.close()

    (plain, i0), (obs, i1) = first({}), first({"textures": True, "seed": 1})  # drawn after the reset
    assert not np.array_equal(plain["observation.images.front"], obs["observation.images.front"])
    assert plain["task"] == obs["task"] and i0["target_distance"] == i1["target_distance"]
    with pytest.raises(ConfigError, match="distractors: .* has 0 distractor geoms"):
        first({"distractors": 1})
