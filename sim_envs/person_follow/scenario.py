"""Per-episode scene generation: target walk, obstacles, other people, robot start, looks.

Everything is drawn from one ``numpy.random.Generator`` so an episode is a pure function
of its seed. Constraints that keep the task solvable and realistic:

* the target's walk stays in the open (>= 1.2 m from walls, obstacles >= 1.3 m from it);
* the robot starts 1.6-2.4 m behind the target, facing it, with a clear line of sight;
* other people avoid obstacles and keep >= 1 m (space-time) from the target and from where
  the robot will roughly be (the target's path, delayed), so crossings in front of the
  robot happen (occlusions) without anyone walking through anyone;
* at t=0 the target is the person closest to the image centre (needed by the ``at`` split),
  except in the ``dt`` decoy episodes (a share ``DT_DECOY_SHARE`` of ``dt``): there the robot
  starts facing between the target and a distractor who is at least as central (|bearing| no
  larger) and at least as near as the target, so locking on the centred or nearest person fails
  and only the instruction tells them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from sim_envs.person_follow.geometry import BOX, CYLINDER, clearance, obstacle_distance, segment_point_distance, wrap_angle
from sim_envs.person_follow.people import Appearance, instruction, sample_appearances, walk
from sim_envs.person_follow.scene import MAX_OBSTACLES, MAX_PEOPLE, N_BOX_OBSTACLES, ROOM_HALF

TARGET_SPEED = (0.4, 1.1)  # the target never outruns the robot (v_max 1.2 m/s)
OTHER_SPEED = (0.4, 1.4)
SPACING_TARGET = 0.75  # min space-time distance of others to the target
SPACING_ROBOT = 0.8  # ... to the robot's nominal (delayed target) path
SPACING_OTHERS = 0.8
DT_DECOY_SHARE = 0.7  # dt episodes that start with a decoy (a distractor as central and as near as the target)
DECOY_TARGET_BEARING = (0.35, 0.6)  # rad: |target bearing| at t=0 in a decoy episode (in frame at 90 deg hfov)
DECOY_DISTANCE_MIN = 1.3  # m from the robot
DECOY_SIGHT_GAP = 1.0  # m: the decoy keeps this far from the robot-target segment (no occlusion, room to pass)


@dataclass
class Scenario:
    people: list[Appearance]
    trajs: list[np.ndarray]  # per person (T_i, 3) poses at the control ticks; target first
    target_ticks: int  # index of the target's last scripted tick (its episode length)
    obstacles: np.ndarray  # (MAX_OBSTACLES, 6) rows (x, y, yaw, hx, hy, kind)
    obstacle_mask: np.ndarray  # (MAX_OBSTACLES,) bool
    obstacle_height: np.ndarray  # (MAX_OBSTACLES,)
    robot_start: np.ndarray  # (3,)
    instruction: str
    looks: dict = field(default_factory=dict)


def _pad(traj: np.ndarray, n: int) -> np.ndarray:
    if len(traj) >= n:
        return traj[:n]
    return np.concatenate([traj, np.repeat(traj[-1:], n - len(traj), axis=0)])


def _target_walk(rng: np.random.Generator, dt: float):
    margin = ROOM_HALF - 2.5
    for _ in range(200):
        p0 = rng.uniform(-margin, margin, size=2)
        yaw0 = float(rng.uniform(-np.pi, np.pi))
        d0 = float(rng.uniform(1.6, 2.4))
        heading = np.array([np.cos(yaw0), np.sin(yaw0)])
        robot_xy = p0 - d0 * heading + rng.uniform(-0.15, 0.15) * np.array([-heading[1], heading[0]])
        if np.max(np.abs(robot_xy)) > ROOM_HALF - 1.0:
            continue
        rel = p0 - robot_xy
        robot_yaw = float(wrap_angle(np.arctan2(rel[1], rel[0]) + rng.uniform(-0.1, 0.1)))
        n_goals = int(rng.integers(1, 4))
        goals, stops = [], []
        pos, yaw = p0, yaw0
        ok = True
        for g in range(n_goals):
            for _ in range(50):
                turn = rng.uniform(-0.6, 0.6) if g == 0 else rng.uniform(-1.75, 1.75)
                dist = rng.uniform(3.5, 7.0) if g == 0 else rng.uniform(3.0, 7.0)
                cand = pos + dist * np.array([np.cos(yaw + turn), np.sin(yaw + turn)])
                if np.max(np.abs(cand)) <= ROOM_HALF - 1.6:
                    break
            else:
                ok = False
                break
            goals.append(cand)
            stops.append(int(rng.integers(5, 21)) if (g < n_goals - 1 and rng.random() < 0.35) else 0)
            yaw = float(np.arctan2(cand[1] - pos[1], cand[0] - pos[0]))
            pos = cand
        if not ok:
            continue
        stops[-1] = int(rng.integers(5, 16))  # final stop: wait 5-15 steps, then the episode ends
        speed = float(rng.uniform(*TARGET_SPEED))
        traj = walk(p0, yaw0, goals, speed, stops, dt, initial_wait=int(rng.integers(0, 4)))
        if np.max(np.abs(traj[:, :2])) > ROOM_HALF - 1.2:
            continue
        return traj, np.array([robot_xy[0], robot_xy[1], robot_yaw]), speed
    raise RuntimeError("could not generate a target walk")


def _obstacles(rng: np.random.Generator, target_path: np.ndarray, robot_xy: np.ndarray, target_xy: np.ndarray):
    obstacles = np.zeros((MAX_OBSTACLES, 6))
    mask = np.zeros(MAX_OBSTACLES, dtype=bool)
    heights = np.zeros(MAX_OBSTACLES)
    n = int(rng.integers(3, MAX_OBSTACLES + 1))
    slots = rng.choice(MAX_OBSTACLES, size=n, replace=False)
    path = target_path[::3, :2]
    for slot in slots:
        is_box = slot < N_BOX_OBSTACLES
        for _ in range(30):
            if is_box:
                row = np.array([
                    *rng.uniform(-ROOM_HALF + 0.3, ROOM_HALF - 0.3, size=2),
                    rng.uniform(-np.pi, np.pi), rng.uniform(0.25, 0.8), rng.uniform(0.25, 0.8), BOX,
                ])
            else:
                row = np.array([*rng.uniform(-ROOM_HALF + 0.4, ROOM_HALF - 0.4, size=2), 0.0, rng.uniform(0.15, 0.35), 0.0, CYLINDER])
            d_path = obstacle_distance(path, row[None])[:, 0].min()
            d_robot = obstacle_distance(robot_xy[None], row[None])[0, 0]
            # keep the start line of sight clear
            seg = segment_point_distance(robot_xy, target_xy, row[None, :2])[0] - max(row[3], row[4])
            others = obstacles[mask]
            sep = np.inf if not len(others) else np.min(np.hypot(*(others[:, :2] - row[:2]).T) - others[:, 3:5].max(1) - max(row[3], row[4]))
            if d_path >= 1.3 and d_robot >= 1.0 and seg >= 0.6 and sep >= 0.9:
                obstacles[slot] = row
                mask[slot] = True
                heights[slot] = rng.choice([rng.uniform(0.5, 1.1), rng.uniform(1.5, 2.0)]) if is_box else 2.5
                break
    return obstacles, mask, heights


def _nominal_robot(target: np.ndarray, robot_start: np.ndarray, speed: float, dt: float) -> np.ndarray:
    """Where a follower ~2 m behind the target will roughly be at each tick."""
    lag = min(int(round(2.0 / max(speed, 0.4) / dt)), len(target))  # short episodes: never catches up
    out = np.empty((len(target), 2))
    out[:lag] = robot_start[:2]
    out[lag:] = target[: len(target) - lag, :2]
    return out


def _other_walk(rng, kind, target, dt, horizon, obstacles):
    margin = ROOM_HALF - 0.7
    speed = float(rng.uniform(*OTHER_SPEED))
    if kind == "idle":
        p = rng.uniform(-margin, margin, size=2)
        return np.repeat([[p[0], p[1], rng.uniform(-np.pi, np.pi)]], 1, axis=0)
    if kind == "cross":
        t_star = int(rng.integers(5, max(6, len(target) - 5)))
        p_star = target[t_star, :2]
        th = target[t_star, 2] + (np.pi / 2) * rng.choice([-1, 1]) + rng.uniform(-0.7, 0.7)
        u = np.array([np.cos(th), np.sin(th)])
        t_cross = t_star + int(rng.choice([-1, 1]) * rng.integers(8, 30))
        a = min(rng.uniform(2.5, 5.0), speed * dt * max(t_cross, 0) * 0.9)
        if a < 1.0:
            return None
        start = p_star - a * u
        wait = max(0, int(t_cross - a / (speed * dt) - 5))
        end = p_star + rng.uniform(2.5, 5.0) * u
        goals = [p_star, end, rng.uniform(-margin, margin, size=2)]
        stops = [0, int(rng.integers(0, 20)), 0]
        if np.max(np.abs(np.stack([start, end]))) > margin:
            return None
        return walk(start, th, goals, speed, stops, dt, initial_wait=wait, max_ticks=horizon + 50)
    start = rng.uniform(-margin, margin, size=2)
    goals = [rng.uniform(-margin, margin, size=2) for _ in range(int(rng.integers(2, 5)))]
    stops = [int(rng.integers(0, 30)) if rng.random() < 0.3 else 0 for _ in goals]
    yaw0 = float(np.arctan2(goals[0][1] - start[1], goals[0][0] - start[0]))
    return walk(start, yaw0, goals, speed, stops, dt, initial_wait=int(rng.integers(0, 20)), max_ticks=horizon + 50)


def _decoy_walk(rng, target, robot_start, active, tgt, robot_nom, horizon, dt):
    """A distractor who starts at least as central and as near as the target, seen from the robot
    (``robot_start``, already turned to face between them), then stands or wanders off; its
    ``(T, 3)`` walk, or None when no placement keeps the spacing rules."""
    rxy, ryaw = robot_start[:2], robot_start[2]
    rel = target[0, :2] - rxy
    d_t = float(np.hypot(*rel))
    b_t = abs(float(wrap_angle(np.arctan2(rel[1], rel[0]) - ryaw)))
    margin = ROOM_HALF - 0.7
    lag = min(int(round(2.0 / 0.4 / dt)), horizon)  # the longest time the robot may take to reach the target's start
    for _try in range(40):
        b = ryaw + rng.uniform(-b_t, b_t)
        d = rng.uniform(DECOY_DISTANCE_MIN, d_t)
        p0 = rxy + d * np.array([np.cos(b), np.sin(b)])
        if np.max(np.abs(p0)) > margin or segment_point_distance(rxy, target[0, :2], p0) < DECOY_SIGHT_GAP:
            continue
        if len(active) and np.min(segment_point_distance(rxy, p0, active[:, :2]) - active[:, 3:5].max(1)) < 0.3:
            continue  # an obstacle hides the decoy
        yaw0 = float(rng.uniform(-np.pi, np.pi))
        if rng.random() < 0.3:
            tr = np.array([[p0[0], p0[1], yaw0]])
        else:
            goals = [rng.uniform(-margin, margin, size=2) for _ in range(int(rng.integers(1, 4)))]
            stops = [int(rng.integers(0, 30)) if rng.random() < 0.3 else 0 for _ in goals]
            tr = walk(p0, yaw0, goals, float(rng.uniform(*OTHER_SPEED)), stops, dt,
                      initial_wait=int(rng.integers(0, 15)), max_ticks=horizon + 50)
        pt = _pad(tr, horizon)
        if np.min(clearance(pt[:, :2], active, ROOM_HALF)) < 0.5:
            continue
        if np.min(np.linalg.norm(pt[:, :2] - tgt[:, :2], axis=1)) < SPACING_TARGET:
            continue
        if np.min(np.linalg.norm(pt[lag:, :2] - robot_nom[lag:], axis=1), initial=np.inf) < SPACING_ROBOT:
            continue
        if np.min(segment_point_distance(rxy, target[0, :2], pt[:lag, :2])) < SPACING_ROBOT:
            continue  # in the way while the robot closes in on the target's start
        return tr
    return None


def decoy_at_start(robot_start: np.ndarray, positions: np.ndarray) -> bool:
    """Whether someone else (``positions[1:]``, xy at t=0) is at least as central (|bearing| no
    larger) and at least as near as the target (``positions[0]``), seen from ``robot_start``."""
    rel = np.asarray(positions)[:, :2] - robot_start[:2]
    dist = np.hypot(rel[:, 0], rel[:, 1])
    bear = np.abs(wrap_angle(np.arctan2(rel[:, 1], rel[:, 0]) - robot_start[2]))
    return bool(np.any((bear[1:] <= bear[0]) & (dist[1:] <= dist[0])))


def generate_scenario(rng: np.random.Generator, split: str, max_steps: int, dt: float, n_others: int | None = None) -> Scenario:
    horizon = max_steps + 1
    for _attempt in range(50):
        target, robot_start, speed = _target_walk(rng, dt)
        target_ticks = len(target) - 1
        obstacles, omask, oheight = _obstacles(rng, target, robot_start[:2], target[0, :2])
        active = obstacles[omask]
        tgt = _pad(target, horizon)
        robot_nom = _nominal_robot(tgt, robot_start, speed, dt)
        lo = 0 if split == "stt" else 1
        n_want = int(rng.integers(lo, MAX_PEOPLE)) if n_others is None else int(n_others)
        people = sample_appearances(rng, split, n_want)
        trajs = [target]
        padded = []
        kept = [people[0]]
        if split == "dt" and len(people) > 1 and rng.random() < DT_DECOY_SHARE:
            to_target = float(np.arctan2(*(target[0, 1::-1] - robot_start[1::-1])))
            robot_start = robot_start.copy()
            robot_start[2] = wrap_angle(to_target - rng.choice([-1.0, 1.0]) * rng.uniform(*DECOY_TARGET_BEARING))
            decoy = _decoy_walk(rng, target, robot_start, active, tgt, robot_nom, horizon, dt)
            if decoy is None:
                continue
            trajs.append(decoy)
            padded.append(_pad(decoy, horizon))
            kept.append(people[1])
            people = [people[0], *people[2:]]
        t_bearing = abs(wrap_angle(np.arctan2(*(target[0, 1::-1] - robot_start[1::-1])) - robot_start[2]))
        for k in range(1, len(people)):
            ok = False
            for _try in range(40):
                kind = rng.choice(["idle", "cross", "wander"], p=[0.2, 0.5, 0.3])
                tr = _other_walk(rng, kind, target, dt, horizon, active)
                if tr is None:
                    continue
                pt = _pad(tr, horizon)
                if np.min(clearance(pt[:, :2], active, ROOM_HALF)) < 0.5:
                    continue
                if np.min(np.linalg.norm(pt[:, :2] - tgt[:, :2], axis=1)) < SPACING_TARGET:
                    continue
                if np.min(np.linalg.norm(pt[:, :2] - robot_nom, axis=1)) < SPACING_ROBOT:
                    continue
                if padded and np.min(np.linalg.norm(np.stack(padded)[:, :, :2] - pt[None, :, :2], axis=2)) < SPACING_OTHERS:
                    continue
                # Clear start: nobody blocks the line of sight, the target is closest to the centre.
                p0 = pt[0, :2]
                if segment_point_distance(robot_start[:2], target[0, :2], p0) < 0.7:
                    continue
                rel = p0 - robot_start[:2]
                bearing = abs(wrap_angle(np.arctan2(rel[1], rel[0]) - robot_start[2]))
                if bearing < t_bearing + 0.3:
                    continue
                ok = True
                break
            if ok:
                trajs.append(tr)
                padded.append(pt)
                kept.append(people[k])
        if split == "dt" and len(kept) < 2:
            continue
        if split == "at" and not any(p.attributes() == kept[0].attributes() for p in kept[1:]):
            continue
        text = instruction(rng, split, kept)
        looks = {
            "floor_rgba": np.array([*rng.uniform(0.35, 0.8, size=3), 1.0]),
            "wall_rgba": np.array([*rng.uniform(0.55, 0.95, size=3), 1.0]),
            "obstacle_rgb": rng.uniform(0.2, 0.8, size=(MAX_OBSTACLES, 3)),
            "light_dir": np.array([*rng.uniform(-0.6, 0.6, size=2), -1.0]),
            "light_diffuse": rng.uniform(0.45, 0.8) * np.ones(3) + rng.uniform(-0.05, 0.05, size=3),
            "ambient": float(rng.uniform(0.25, 0.4)),
        }
        return Scenario(
            people=kept,
            trajs=trajs,
            target_ticks=target_ticks,
            obstacles=obstacles,
            obstacle_mask=omask,
            obstacle_height=oheight,
            robot_start=robot_start,
            instruction=text,
            looks=looks,
        )
    raise RuntimeError(f"could not generate a {split} scenario")


def retarget(sc: Scenario, order: list[int], rng: np.random.Generator) -> Scenario:
    """The same scene with ``sc.people[order[0]]`` as the target: people and walks put in
    ``order`` (the target first), an instruction that names the new target by everything that
    tells them apart from the others (the ``dt`` phrasing: shirt, trousers, and hat and height
    wherever someone else differs in them), and the episode as long as before."""
    people = [sc.people[k] for k in order]
    return replace(sc, people=people, trajs=[sc.trajs[k] for k in order], instruction=instruction(rng, "dt", people))
