"""Arm tasks (SO-101-like): API compliance, determinism, vector envs, IK, oracle, physics."""

from __future__ import annotations

import gymnasium
import mujoco
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import sim_envs  # noqa: F401  (registers the tasks)
from sim_envs.arm import so101
from sim_envs.arm.env import ArmPickPlaceEnv, ArmPushCubeEnv, ArmReachEnv
from sim_envs.arm.ik import ArmIK
from sim_envs.core import make_oracle

IDS = {
    "reach": "robopolicy/ArmReach-v0",
    "push": "robopolicy/ArmPushCube-v0",
    "pickplace": "robopolicy/ArmPickPlace-v0",
}


def run_oracle(env, seed, noise=0.0, max_steps=None):
    oracle = make_oracle(env, noise=noise, seed=seed)
    obs, info = env.reset(seed=seed)
    oracle.reset(obs, info)
    for _ in range(max_steps or 10_000):
        step = oracle.act(obs, info)
        obs, _, terminated, truncated, info = env.step(step.action)
        if terminated or truncated:
            break
    return obs, info


@pytest.mark.parametrize("task", list(IDS))
@pytest.mark.parametrize("action_mode", ["joint", "ee_delta"])
def test_check_env(task, action_mode):
    env = gymnasium.make(IDS[task], image_size=32, action_mode=action_mode)
    check_env(env.unwrapped, skip_render_check=True)
    obs, info = env.reset(seed=0)
    assert set(obs) == {"observation.images.front", "observation.images.wrist", "observation.state", "task"}
    assert obs["observation.images.front"].shape == (32, 32, 3)
    assert obs["observation.state"].shape == (6,) and obs["observation.state"].dtype == np.float32
    assert env.observation_space["task"].contains(obs["task"])
    assert env.action_space.shape == ((6,) if action_mode == "joint" else (4,))
    env.close()


def test_state_only_observation_and_truncation():
    env = gymnasium.make(IDS["reach"], use_cameras=False, max_steps=5)
    obs, info = env.reset(seed=1)
    assert set(obs) == {"observation.state", "task"}
    for k in range(5):
        obs, reward, terminated, truncated, info = env.step(obs["observation.state"])
        assert isinstance(info["is_success"], bool)
        assert not terminated
        assert truncated == (k == 4)
    metrics = info["episode_metrics"]
    assert metrics["steps"] == 5 and metrics["success"] is False


@pytest.mark.parametrize("task", ["push", "pickplace"])
def test_determinism(task):
    def rollout():
        env = gymnasium.make(IDS[task], image_size=24)
        oracle = make_oracle(env, noise=0.3, seed=5)
        obs, info = env.reset(seed=123)
        oracle.reset(obs, info)
        trace = [(obs, info)]
        for _ in range(12):
            obs, r, te, tr, info = env.step(oracle.act(obs, info).action)
            trace.append((obs, info))
        env.close()
        return trace

    a, b = rollout(), rollout()
    for (oa, ia), (ob, ib) in zip(a, b):
        for key in oa:
            if isinstance(oa[key], str):
                assert oa[key] == ob[key]
            else:
                np.testing.assert_array_equal(oa[key], ob[key])
        np.testing.assert_array_equal(ia["cube_pos"], ib["cube_pos"])
        np.testing.assert_array_equal(ia["ee_pos"], ib["ee_pos"])
    # a different seed gives a different scene
    env = gymnasium.make(IDS[task], use_cameras=False)
    _, i1 = env.reset(seed=1)
    _, i2 = env.reset(seed=2)
    assert not np.allclose(i1["cube_pos"], i2["cube_pos"])


def test_async_vector_env():
    # gymnasium's shared-memory path does not update Text observations (it reads the strings
    # once at construction), so vector envs of these tasks use shared_memory=False. "spawn":
    # forking a process that already rendered with EGL (earlier tests did) hangs in the child.
    fns = [lambda: ArmPickPlaceEnv(image_size=24) for _ in range(2)]
    venv = gymnasium.vector.AsyncVectorEnv(fns, shared_memory=False, context="spawn")
    try:
        obs, info = venv.reset(seed=[3, 4])
        assert obs["observation.state"].shape == (2, 6)
        assert obs["observation.images.wrist"].shape == (2, 24, 24, 3)
        assert all(t.startswith("put the ") for t in obs["task"])
        assert obs["task"] == tuple(info["task"])
        for _ in range(3):
            obs, rew, term, trunc, info = venv.step(obs["observation.state"])
        assert rew.shape == (2,) and info["cube_pos"].shape == (2, 3, 3)
    finally:
        venv.close()


def test_bad_inputs():
    with pytest.raises(ValueError, match="image_size"):
        ArmReachEnv(image_size=0)
    with pytest.raises(ValueError, match="action_mode"):
        ArmReachEnv(action_mode="torque")
    with pytest.raises(ValueError, match="use_cameras"):
        ArmReachEnv(use_cameras="yes")
    with pytest.raises(ValueError, match="num_cubes"):
        ArmPickPlaceEnv(num_cubes=9)
    with pytest.raises(ValueError, match="render_mode"):
        ArmPushCubeEnv(render_mode="human")
    with pytest.raises(TypeError):
        ArmPushCubeEnv(num_cubes=2)  # push has exactly one cube
    env = ArmPushCubeEnv(use_cameras=False)
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(seed=0, options={"difficulty": 3})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="non-finite"):
        env.step(np.array([0, 0, np.nan, 0, 0, 0], np.float32))
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros(4, np.float32))
    # out-of-range actions are clipped, not rejected
    obs, *_ = env.step(np.full(6, 100.0, np.float32))
    assert np.all(np.isfinite(obs["observation.state"]))


def test_ik_reaches_reachable_points():
    ik = ArmIK()
    home, ok = ik.analytic(np.array([0.14, 0.0, 0.10]))
    assert ok
    rng = np.random.default_rng(0)
    for _ in range(20):
        r, a, z = rng.uniform(0.10, 0.23), rng.uniform(-1.2, 1.2), rng.uniform(0.01, 0.09)
        target = np.array([r * np.cos(a), r * np.sin(a), z])
        # closed form, then damped least squares from the home pose (no analytic seed)
        q, ok = ik.analytic(target)
        pos, rot = ik.fk(q)
        assert ok and np.linalg.norm(pos - target) < 1e-6 and rot[2, 0] < -0.9999
        q2, err = ik.solve(target, home, iters=200)
        pos2, rot2 = ik.fk(q2)
        assert err < 1e-3 and np.linalg.norm(pos2 - target) < 1e-3
        assert rot2[2, 0] < -0.995  # gripper still points down
        assert np.all(q2 >= so101.JOINT_LOW[:5]) and np.all(q2 <= so101.JOINT_HIGH[:5])
    _, ok = ik.analytic(np.array([0.5, 0.0, 0.05]))
    assert not ok  # out of reach is reported


@pytest.mark.parametrize("task,seeds", [("reach", [0, 1, 2]), ("push", [0, 1, 2]), ("pickplace", [0, 1, 2, 3])])
def test_oracle_succeeds(task, seeds):
    env = gymnasium.make(IDS[task], use_cameras=False)
    for seed in seeds:
        _, info = run_oracle(env, seed)
        assert info["episode_metrics"]["success"], (task, seed, info["task"])
        assert info["episode_metrics"]["steps"] < env.unwrapped.max_episode_steps


@pytest.mark.parametrize("task", ["reach", "pickplace"])
def test_oracle_ee_delta_mode(task):
    env = gymnasium.make(IDS[task], use_cameras=False, action_mode="ee_delta")
    _, info = run_oracle(env, 0)
    assert info["episode_metrics"]["success"]


def test_oracle_noise_keeps_clean_label():
    env = gymnasium.make(IDS["reach"], use_cameras=False)
    oracle = make_oracle(env, noise=0.2, seed=0)
    obs, info = env.reset(seed=0)
    oracle.reset(obs, info)
    step = oracle.act(obs, info)
    assert not np.allclose(step.action, step.label)
    assert env.action_space.contains(step.action) and env.action_space.contains(step.label)


def _ik_mover(env, info):
    """``move(xyz, grip, n) -> (obs, info)``: IK joint targets for a tool point, the jaws aligned
    with cube 0, held for ``n`` steps."""
    ik = ArmIK()
    cube = info["cube_pos"][0]
    yaw = 2 * np.arctan2(info["cube_quat"][0][3], info["cube_quat"][0][0])
    q, _ = ik.analytic(np.array([cube[0], cube[1], 0.07]))
    roll = ik.roll_for_yaw(q, yaw, symmetry=np.pi / 2)

    def move(xyz, grip, n):
        qq, ok = ik.analytic(np.asarray(xyz, dtype=float), roll=roll)
        assert ok
        for _ in range(n):
            obs, _, _, _, info = env.step(np.concatenate([qq, [grip]]))
        return obs, info

    return move


def test_grasped_cube_stays_in_gripper_while_lifting():
    """Physics sanity without the oracle: IK to the cube, close, lift 9 cm, wave the arm."""
    env = ArmPickPlaceEnv(num_cubes=1, num_bowls=1, use_cameras=False)
    _, info = env.reset(seed=7)
    move = _ik_mover(env, info)
    cube = info["cube_pos"][0]
    move([cube[0], cube[1], 0.07], 1.745, 20)
    move([cube[0], cube[1], so101.CUBE_HALF + 0.001], 1.745, 20)
    obs, info = move([cube[0], cube[1], so101.CUBE_HALF + 0.001], 0.0, 8)
    assert obs["observation.state"][5] > 0.5  # fingers stopped by the cube, not closed
    obs, info = move([cube[0], cube[1], 0.10], 0.0, 20)
    lifted = info["cube_pos"][0]
    assert lifted[2] > 0.08
    assert np.linalg.norm(lifted - info["ee_pos"]) < 0.01
    obs, info = move([0.15, -0.08, 0.10], 0.0, 25)  # carry it sideways
    assert info["cube_pos"][0][2] > 0.08
    assert np.linalg.norm(info["cube_pos"][0] - info["ee_pos"]) < 0.01
    obs, info = move([0.15, -0.08, 0.10], 1.745, 15)  # open: it drops
    assert info["cube_pos"][0][2] < so101.CUBE_HALF + 0.003


def _place(env, cube, bowl_xy):
    adr = env._cube_qadr[cube]
    env.data.qpos[adr : adr + 3] = (bowl_xy[0], bowl_xy[1], so101.CUBE_HALF)
    env.data.qpos[adr + 3 : adr + 7] = (1, 0, 0, 0)
    env.data.qvel[:] = 0
    mujoco.mj_forward(env.model, env.data)


def test_success_is_judged_on_the_named_cube_and_bowl():
    env = ArmPickPlaceEnv(use_cameras=False)
    obs, info = env.reset(seed=11)
    k, b = info["goal_cube"], info["goal_target"]
    assert obs["task"] == f"put the {info['cube_colors'][k]} cube in the {info['target_colors'][b]} bowl"
    # the privileged label of the named objects (auxiliary losses): goal cube xyz, goal bowl xyz
    np.testing.assert_allclose(info["goal_pos"], np.concatenate([info["cube_pos"][k], info["target_pos"][b]]), atol=1e-6)
    hold = obs["observation.state"].copy()  # keep the arm still, gripper open
    wrong_cube = (k + 1) % env.num_cubes
    wrong_bowl = (b + 1) % env.num_targets
    _place(env, wrong_cube, info["target_pos"][b])
    _, _, terminated, _, info2 = env.step(hold)
    assert not info2["is_success"] and not terminated
    _place(env, k, info["target_pos"][wrong_bowl])
    _, _, _, _, info2 = env.step(hold)
    assert not info2["is_success"]
    _place(env, k, info["target_pos"][b])
    _place(env, wrong_cube, [0.2, 0.25])
    results = [env.step(hold) for _ in range(3)]
    assert all(r[4]["is_success"] for r in results)
    assert results[-1][2]  # terminated after holding success for a few steps
    assert results[-1][4]["episode_metrics"]["success"]


def test_push_success_requires_cube_in_zone():
    env = ArmPushCubeEnv(use_cameras=False)
    obs, info = env.reset(seed=3)
    assert not info["is_success"]
    assert info["cube_colors"][0] in obs["task"] and info["target_colors"][0] in obs["task"]
    _place(env, 0, info["target_pos"][0])
    _, _, _, _, info = env.step(obs["observation.state"])
    assert info["is_success"]


def test_render_views_and_render():
    env = gymnasium.make(IDS["pickplace"], render_mode="rgb_array", image_size=32, render_size=64)
    env.reset(seed=0)
    views = env.unwrapped.render_views()
    assert set(views) == {"front", "wrist", "topdown"}
    assert all(v.shape == (64, 64, 3) and v.dtype == np.uint8 for v in views.values())
    frame = env.render()
    assert frame.shape == (64, 192, 3)
    assert frame.std() > 5  # not a blank image
    env.close()


def test_pickplace_splits_hold_out_goal_pairs():
    held = ArmPickPlaceEnv.HELDOUT_PAIRS
    for split, expect_heldout in (("train", False), ("test", True)):
        env = ArmPickPlaceEnv(use_cameras=False, split=split)
        for seed in range(15):
            _, info = env.reset(seed=seed)
            pair = (info["cube_colors"][info["goal_cube"]], info["target_colors"][info["goal_target"]])
            assert (pair in held) == expect_heldout, (split, seed, pair)
            assert len(set(info["cube_colors"])) == env.num_cubes
    with pytest.raises(ValueError, match="split"):
        ArmPickPlaceEnv(split="val")


def test_point_reach_has_a_known_answer():
    import gymnasium

    from sim_envs import make_oracle

    env = gymnasium.make("robopolicy/PointReach-v0", render_mode="rgb_array", render_size=48)
    wins, steps = 0, []
    oracle = make_oracle(env)
    for seed in range(20):
        obs, info = env.reset(seed=seed)
        oracle.reset(obs, info)
        for t in range(60):
            obs, reward, term, trunc, info = env.step(oracle.act(obs, info).action)
            if term or trunc:
                break
        wins += info["episode_metrics"]["success"]
        steps.append(t + 1)
    assert wins == 20 and max(steps) <= 15  # straight at the goal: never more than ~11 steps
    assert env.render().shape == (48, 48, 3)
    with pytest.raises(ValueError, match="non-finite"):
        env.step(np.array([np.nan, 0.0]))
    with pytest.raises(ValueError, match="tolerance"):
        gymnasium.make("robopolicy/PointReach-v0", tolerance=2.0)


def test_pose_draws_task_poses_with_consistent_labels():
    """pose(): kinematic poses around the named cube and bowl, labels as the env computes them."""
    env = ArmPickPlaceEnv(image_size=32)
    _, info0 = env.reset(seed=3)
    start = info0["cube_pos"][info0["goal_cube"]].copy()
    others = np.delete(info0["cube_pos"], info0["goal_cube"], axis=0)
    bowl = info0["target_pos"][info0["goal_target"]]
    rng = np.random.default_rng(0)
    held = placed = at_start = 0
    for _ in range(60):
        env.reset(seed=3)
        obs, info = env.pose(rng)
        assert obs["observation.images.front"].shape == (32, 32, 3) and obs["task"] == info0["task"]
        k = info["goal_cube"]
        cube, ee = info["cube_pos"][k], info["ee_pos"]
        assert np.allclose(info["goal_grip"][:3], cube - ee, atol=1e-6)
        assert np.allclose(info["goal_grip"][3:], bowl, atol=1e-6)
        assert np.allclose(np.delete(info["cube_pos"], k, axis=0), others)  # the rest of the layout stays
        assert np.allclose(obs["observation.state"][:5], env.data.qpos[env._arm_qadr])
        assert 0.0 <= obs["observation.state"][5] <= so101.JOINT_HIGH[5] + 1e-6
        if np.linalg.norm(cube - start) < 1e-9:
            at_start += 1
        elif np.linalg.norm(cube - ee) < 0.005:  # carried: between the jaws, fingers on its faces
            held += 1
            assert cube[2] > so101.CUBE_HALF
            # the dense reward does not charge for the cube's height: carrying it over the bowl's wall is free
            _, reward, _ = env._evaluate()
            assert reward == pytest.approx(-np.linalg.norm(ee - cube) - 2.0 * np.linalg.norm(cube[:2] - bowl[:2]))
            # closed on the cube: at most the touching angle, as low as the fingers press in physics
            assert env.CARRY_GRIP_LOW - 1e-6 <= obs["observation.state"][5] <= env.CARRY_GRIP_TOUCH + 1e-6
            assert env.CARRY_GRIP_TOUCH * so101.GRIP_M_PER_RAD == pytest.approx(so101.CUBE_HALF - so101.PAD_INNER_GAP)
        else:  # placed in the bowl
            placed += 1
            assert np.linalg.norm(cube[:2] - bowl[:2]) < so101.BOWL_RADIUS
    assert at_start > 10 and held > 10 and placed > 2
    # the same generator state gives the same pose
    env.reset(seed=3)
    a, _ = env.pose(np.random.default_rng(5))
    env.reset(seed=3)
    b, _ = env.pose(np.random.default_rng(5))
    assert np.array_equal(a["observation.state"], b["observation.state"])
    assert np.array_equal(a["observation.images.wrist"], b["observation.images.wrist"])
    env.close()


def test_pose_phase_weights_choose_the_phases():
    env = ArmPickPlaceEnv(use_cameras=False)
    _, info0 = env.reset(seed=4)
    start = info0["cube_pos"][info0["goal_cube"]].copy()
    rng = np.random.default_rng(1)
    for _ in range(5):  # the reset pose: the arm within the reset's joint noise of home, the cube where it was
        obs, info = env.pose(rng, {"start": 1.0, "free": 0.0, "approach": 0.0, "carry": 0.0, "placed": 0.0})
        assert np.abs(obs["observation.state"][:5] - env._home).max() < 0.2
        assert obs["observation.state"][5] == pytest.approx(so101.JOINT_HIGH[5])
        assert np.allclose(info["cube_pos"][info["goal_cube"]], start)
    only_carry = {"free": 0.0, "approach": 0.0, "carry": 1.0, "placed": 0.0}
    for _ in range(5):
        _, info = env.pose(rng, only_carry)
        assert np.linalg.norm(info["goal_grip"][:3]) < 0.005
    # poses of one layout follow each other without a reset: each starts from the layout, so a
    # cube carried in one pose is back in its place for the next
    env.reset(seed=4)
    for _ in range(3):
        _, info = env.pose(rng, only_carry)
        assert np.linalg.norm(info["cube_pos"][info["goal_cube"]] - start) > 0.01
        _, info = env.pose(rng, {"start": 1.0, "free": 0.0, "approach": 0.0, "carry": 0.0, "placed": 0.0})
        assert np.allclose(info["cube_pos"][info["goal_cube"]], start)
    with pytest.raises(RuntimeError, match="reset"):
        ArmPickPlaceEnv(use_cameras=False).pose(rng)
    with pytest.raises(ValueError, match="unknown"):
        env.pose(rng, {"hover": 1.0})
    with pytest.raises(ValueError, match="positive sum"):
        env.pose(rng, {k: 0.0 for k in ArmPickPlaceEnv.POSE_PHASES})


def test_replan_labels_from_where_the_arm_is():
    """``replan``: while the oracle drives, its labels are unchanged; when something else holds the
    arm, the commanded point follows the tool instead of the oracle's own path."""
    from sim_envs.arm.oracle import REANCHOR, V_MOVE

    for task in ("push", "pickplace"):
        env = gymnasium.make(IDS[task], use_cameras=False)
        plain, replan = make_oracle(env), make_oracle(env)
        replan.replan = True
        for seed in (0, 1):
            obs, info = env.reset(seed=seed)
            plain.reset(obs, info)
            replan.reset(obs, info)
            for _ in range(60):  # the oracle drives
                a, b = plain.label(obs, info).label, replan.label(obs, info).label
                np.testing.assert_array_equal(a, b)
                obs, _, _, _, info = env.step(a)
    env = gymnasium.make(IDS["pickplace"], use_cameras=False)
    plain, replan = make_oracle(env), make_oracle(env)
    replan.replan = True
    obs, info = env.reset(seed=2)
    plain.reset(obs, info)
    replan.reset(obs, info)
    hold = obs["observation.state"].copy()
    for _ in range(30):  # another policy holds the arm where it started
        plain.label(obs, info)
        replan.label(obs, info)
        obs, _, _, _, info = env.step(hold)
    ee = np.asarray(info["ee_pos"])
    assert np.linalg.norm(plain.cmd - ee) > 2 * REANCHOR  # the plain oracle's path went on without the arm
    replan.label(obs, info)
    assert np.linalg.norm(replan.cmd - ee) <= V_MOVE + 1e-6  # one bounded step from the tool


def test_replan_keeps_a_carried_cube_closed():
    """A cube the arm carries is never re-approached with opening jaws under ``replan``."""
    from sim_envs.arm.oracle import CLOSED

    env = ArmPickPlaceEnv(num_cubes=1, num_bowls=1, use_cameras=False)
    _, info = env.reset(seed=7)
    move = _ik_mover(env, info)
    cube = info["cube_pos"][0]
    for xyz, grip, n in (((cube[0], cube[1], 0.07), 1.745, 20), ((cube[0], cube[1], so101.CUBE_HALF + 0.001), 1.745, 20),
                         ((cube[0], cube[1], so101.CUBE_HALF + 0.001), 0.0, 8), ((cube[0], cube[1], 0.10), 0.0, 20)):
        obs, info = move(xyz, grip, n)
    assert info["cube_pos"][0][2] > 0.08  # carried
    labels = {}
    for name in ("plain", "replan"):
        oracle = make_oracle(env)
        oracle.replan = name == "replan"
        oracle.reset(obs, info)  # a fresh oracle starts by approaching the cube
        labels[name] = oracle.label(obs, info).label
        phase = oracle.phase
    assert labels["plain"][5] > CLOSED + 0.1  # it would open the jaws and drop the cube
    assert labels["replan"][5] == CLOSED and phase == "lift"


def test_oracle_chunk_is_the_oracles_own_future_and_leaves_the_episode_as_it_was():
    """The counterfactual chunk equals what the oracle then executes, and asking for it changes
    nothing in the episode (observations match an env that was never asked)."""
    from robopolicy.envs import EnvConfig
    from robopolicy.eval.envs import make_task_env

    cfg = EnvConfig(IDS["pickplace"], {"use_cameras": False, "env_state": True})
    plain, asked = make_task_env(cfg, oracle=True), make_task_env(cfg, oracle=True, label_chunk=16)
    (o0, i0), (o1, i1) = plain.reset(seed=5), asked.reset(seed=5)
    labels, chunks, done = [], [], False
    while not done:
        np.testing.assert_array_equal(o0["observation.state"], o1["observation.state"])
        np.testing.assert_array_equal(o0["observation.environment_state"], o1["observation.environment_state"])
        labels.append(i0["oracle_label"])
        chunks.append(i1["oracle_chunk"][: i1["oracle_chunk_len"]])
        assert i1["oracle_chunk"].shape == (16, 6)
        o0, _, term, trunc, i0 = plain.step(i0["oracle_label"])
        o1, _, _, _, i1 = asked.step(i1["oracle_label"])
        done = term or trunc
    assert i0["episode_metrics"]["success"]
    executed = np.stack(labels)
    for j, chunk in enumerate(chunks):
        np.testing.assert_allclose(chunk, executed[j : j + 16][: len(chunk)], atol=1e-6)
        assert len(chunk) == min(16, len(executed) - j)  # shorter only where the episode ends
    with pytest.raises(ValueError, match="oracle_chunk"):
        make_task_env(EnvConfig("robopolicy/PersonFollow-v0", {"split": "dt"}), oracle=True, label_chunk=4)
    with pytest.raises(ValueError, match="lacks"):
        asked.unwrapped.set_state({"sim": np.zeros(3)})


def test_pickplace_staged_reward_ranks_the_phases_of_a_pick():
    """reward="staged": a carried cube is worth more than the arm's start pose, and a placed one
    more than the start on average; never above 0 before success."""
    env = ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="staged")
    rng = np.random.default_rng(1)
    by_phase: dict[str, list[float]] = {"start": [], "carry": [], "placed": []}
    for seed in range(6):
        env.reset(seed=seed)
        for phase in by_phase:
            for _ in range(5):
                env.pose(rng, phases={"free": 0, "approach": 0, "carry": 0, "placed": 0} | {phase: 1.0})
                success, reward, dist = env._evaluate()
                assert -1.0 <= reward <= (1.0 if success else 0.0)
                by_phase[phase].append(reward)
    start, carry, placed = (np.array(by_phase[k]) for k in ("start", "carry", "placed"))
    # carried: held 1 and reach 1 - tanh(10 * 1 mm) (the cube sits 1 mm below the tool point), so
    # above -1/3 - 0.0034 whatever the distance to the bowl; the start pose holds nothing and is far
    # from the cube
    assert carry.min() > -1 / 3 - 0.0034 and start.max() < -2 / 3
    assert placed.mean() > start.mean()
    # stepping uses the same reward, and a bad name is refused
    env.reset(seed=0)
    _, r, *_ = env.step(env.data.qpos[env._arm_qadr].tolist() + [1.0])
    assert -1.0 <= r <= 0.0
    with pytest.raises(ValueError, match="reward"):
        ArmPickPlaceEnv(reward="sparse")


def test_pickplace_removed_reward_options_are_refused():
    """The "progress" reward and ``reach_sharpness`` were removed after they measured no gain
    (docs/experiments/2026-12-07-removed-options.md): asking for either is an error, not a silent
    default."""
    with pytest.raises(ValueError, match="reward"):
        ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="progress")
    with pytest.raises((TypeError, ValueError), match="reach_sharpness"):
        ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="staged", reach_sharpness=50.0)


def test_pickplace_align_weight_adds_the_tool_point_over_the_cube_term():
    """align_weight w adds a term to staged's average: 1 - tanh(100 * xy distance of the tool point
    from the goal cube) while the cube is on the table, 1 once it is lifted; w = 0 is staged itself.
    Over the cube's centre the term pays more than 1 cm beside it at the same height."""
    plain = ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="staged")
    zero = ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="staged", align_weight=0.0)
    w = 1.5
    aligned = ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="staged", align_weight=w)
    rng = np.random.default_rng(2)
    for env in (plain, zero, aligned):
        env.reset(seed=6)
    for _ in range(20):
        q = plain.data.qpos[plain._arm_qadr] + rng.normal(0.0, 0.05, 5)
        a = np.clip(np.append(q, 1.0), plain.action_space.low, plain.action_space.high)
        _, r_plain, *_ = plain.step(a)
        _, r_zero, *_ = zero.step(a)
        _, r_aligned, *_ = aligned.step(a)
        assert r_zero == r_plain
        cube = aligned.data.xpos[aligned._cube_body[aligned.goal_cube]]
        xy = np.linalg.norm(aligned.data.site_xpos[aligned._tcp][:2] - cube[:2])
        align = 1.0 if cube[2] > 0.0075 + so101.CUBE_HALF else 1.0 - np.tanh(100.0 * xy)
        assert r_aligned + 1.0 == pytest.approx((3.0 * (r_plain + 1.0) + w * align) / (3.0 + w), abs=1e-9)
    # the same tool point height, over the cube's centre vs 1 cm beside it: the term tells them apart
    cube = aligned.data.xpos[aligned._cube_body[aligned.goal_cube]].copy()
    pays = []
    for dx in (0.0, 0.01):
        aligned.data.site_xpos[aligned._tcp] = cube + np.array([dx, 0.0, 0.03])
        pays.append(aligned._evaluate()[1])
    assert pays[0] > pays[1] + 0.05
    for bad in (-0.5, float("inf"), True):
        with pytest.raises(ValueError, match="align_weight"):
            ArmPickPlaceEnv(image_size=16, use_cameras=False, reward="staged", align_weight=bad)
    with pytest.raises(ValueError, match="dense"):
        ArmPickPlaceEnv(image_size=16, use_cameras=False, align_weight=1.0)
