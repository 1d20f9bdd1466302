"""Person-following metrics: the one place where they are defined (pure functions).

Per step
  following  distance to the target <= FOLLOW_MAX_DISTANCE and the target visible in the
             egocentric image (visible fraction of its body >= VISIBLE_MIN_FRACTION, i.e. in
             frame and not occluded by people or obstacles).
  collision  distance to any person < COLLISION_DISTANCE, or the robot touching an obstacle or
             a wall. The episode terminates (failure).
  lost       distance > LOST_DISTANCE for LOST_STEPS consecutive steps. Terminates (failure).
Per episode
  success        the episode ended (time limit, or the target stopped and waited) while
                 following and within SUCCESS_BAND of the target, with no collision / loss.
  tracking rate  following steps / max(steps, reference steps); pooled over episodes as
                 sum(following) / sum(max(steps, reference)).
  person collision  the episode ended in a collision with a person (< COLLISION_DISTANCE): the
                 collision EVT-Bench counts; ``collision`` also counts obstacles and walls.
  wrong target   the episode ended while following someone else: among the people within
                 FOLLOW_MAX_DISTANCE whose visible fraction is >= VISIBLE_MIN_FRACTION at the
                 final step, the one nearest the robot's heading (smallest |bearing|) is not the
                 target (``followed_person``). Nobody in follow range and view: not a wrong target.
  retargeted     (``instruction="swap"`` episodes) the instruction was changed to name another
                 person, who became the target.
"""

from __future__ import annotations

from typing import Iterable, Mapping

FOLLOW_MAX_DISTANCE = 3.0
VISIBLE_MIN_FRACTION = 0.25
COLLISION_DISTANCE = 0.5
LOST_DISTANCE = 4.0
LOST_STEPS = 20
SUCCESS_BAND = (1.0, 3.0)


def is_visible(visible_fraction: float) -> bool:
    """Enough of the target's body is in frame and unoccluded."""
    return bool(visible_fraction >= VISIBLE_MIN_FRACTION)


def is_following(distance: float, visible_fraction: float) -> bool:
    return bool(distance <= FOLLOW_MAX_DISTANCE and is_visible(visible_fraction))


def is_collision(min_person_distance: float, obstacle_contact: bool) -> bool:
    return bool(min_person_distance < COLLISION_DISTANCE or obstacle_contact)


def update_lost_counter(counter: int, distance: float) -> int:
    """Consecutive steps the target has been farther than LOST_DISTANCE."""
    return int(counter) + 1 if distance > LOST_DISTANCE else 0


def is_lost(counter: int) -> bool:
    return bool(counter >= LOST_STEPS)


def in_success_band(distance: float) -> bool:
    return bool(SUCCESS_BAND[0] <= distance <= SUCCESS_BAND[1])


def is_success(following: bool, distance: float, collision: bool, lost: bool) -> bool:
    """Success condition at the final step (the env also reports it on every step)."""
    return bool(following and in_success_band(distance) and not collision and not lost)


def step_metrics(distance: float, visible_fraction: float, min_person_distance: float, obstacle_contact: bool, lost_counter: int) -> dict:
    following = is_following(distance, visible_fraction)
    collision = is_collision(min_person_distance, obstacle_contact)
    lost = is_lost(lost_counter)
    return {
        "following": following,
        "visible": is_visible(visible_fraction),
        "distance": float(distance),
        "min_person_distance": float(min_person_distance),
        "collision": collision,
        "lost_counter": int(lost_counter),
        "lost": lost,
        "success": is_success(following, distance, collision, lost),
    }


def followed_person(distances, visible_fractions, bearings) -> int | None:
    """Whom the robot is following: of the people (index 0: the target) within FOLLOW_MAX_DISTANCE
    and visible (:func:`is_visible`), the one nearest its heading (smallest |bearing|, rad); None
    when there is nobody."""
    best, best_bearing = None, float("inf")
    for k, (d, f, b) in enumerate(zip(distances, visible_fractions, bearings)):
        if is_following(float(d), float(f)) and abs(float(b)) < best_bearing:
            best, best_bearing = k, abs(float(b))
    return best


def tracking_rate(following_steps: int, steps: int, reference_steps: int) -> float:
    return float(following_steps) / float(max(steps, reference_steps, 1))


def episode_metrics(following_steps: int, steps: int, reference_steps: int, success: bool, collision: bool, lost: bool,
                    person_collision: bool = False, wrong_target: bool = False, retargeted: bool = False) -> dict:
    return {
        "wrong_target": bool(wrong_target),
        "retargeted": bool(retargeted),
        "success": bool(success),
        "collision": bool(collision),
        "person_collision": bool(collision and person_collision),
        "lost": bool(lost),
        "following_steps": int(following_steps),
        "steps": int(steps),
        "reference_steps": int(reference_steps),
        "tracking_rate": tracking_rate(following_steps, steps, reference_steps),
    }


def summarize_episodes(episodes: Iterable[Mapping]) -> dict:
    """Pool episode metrics: success / collision / lost / wrong-target rates, the pooled tracking
    rate, the share of retargeted episodes and the success rate over those alone (None without
    any)."""
    eps = list(episodes)
    n = len(eps)
    if n == 0:
        return {"success_rate": 0.0, "tracking_rate": 0.0, "collision_rate": 0.0, "person_collision_rate": 0.0,
                "lost_rate": 0.0, "wrong_target_rate": 0.0, "retargeted_rate": 0.0,
                "retargeted_success_rate": None, "episodes": 0}
    swapped = [e for e in eps if e.get("retargeted", False)]
    follow = sum(int(e["following_steps"]) for e in eps)
    denom = sum(max(int(e["steps"]), int(e["reference_steps"]), 1) for e in eps)
    return {
        "success_rate": sum(bool(e["success"]) for e in eps) / n,
        "tracking_rate": follow / denom,
        "collision_rate": sum(bool(e["collision"]) for e in eps) / n,
        "person_collision_rate": sum(bool(e.get("person_collision", False)) for e in eps) / n,
        "lost_rate": sum(bool(e["lost"]) for e in eps) / n,
        "wrong_target_rate": sum(bool(e.get("wrong_target", False)) for e in eps) / n,
        "retargeted_rate": len(swapped) / n,
        "retargeted_success_rate": sum(bool(e["success"]) for e in swapped) / len(swapped) if swapped else None,
        "episodes": n,
    }
