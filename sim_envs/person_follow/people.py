"""People: visible attributes, the instruction that names the target, and smooth walks.

A person's walk is scripted at reset as one pose per control tick (a nominal clock); the env
advances each person's clock by one tick per step unless the person yields (waits) because
the robot or a higher-priority person is right in its way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim_envs.person_follow.geometry import wrap_angle

SHIRT_COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.08, 0.08),
    "green": (0.10, 0.62, 0.15),
    "blue": (0.10, 0.25, 0.85),
    "yellow": (0.95, 0.85, 0.10),
    "white": (0.95, 0.95, 0.95),
    "black": (0.07, 0.07, 0.07),
    "orange": (1.00, 0.50, 0.05),
    "purple": (0.50, 0.15, 0.65),
    "pink": (1.00, 0.52, 0.72),
    "grey": (0.50, 0.50, 0.50),
}
TROUSER_COLORS: dict[str, tuple[float, float, float]] = {
    "black": (0.06, 0.06, 0.06),
    "blue": (0.13, 0.20, 0.50),
    "brown": (0.42, 0.25, 0.10),
    "grey": (0.45, 0.45, 0.45),
    "white": (0.92, 0.92, 0.90),
    "beige": (0.80, 0.70, 0.50),
}
HEIGHT_CLASSES: dict[str, tuple[float, float]] = {
    "short": (1.52, 1.60),
    "medium": (1.70, 1.78),
    "tall": (1.88, 1.96),
}
HAT_COLORS = ((0.15, 0.15, 0.35), (0.6, 0.1, 0.1), (0.2, 0.2, 0.2), (0.85, 0.8, 0.6))
SKIN_TONES = ((0.96, 0.80, 0.69), (0.87, 0.67, 0.52), (0.66, 0.46, 0.33), (0.42, 0.28, 0.20))
ATTRIBUTES = ("shirt", "trousers", "hat", "height")

# Characters that instructions may contain (the Text space's charset).
INSTRUCTION_CHARSET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.'-"


@dataclass
class Appearance:
    shirt: str
    trousers: str
    hat: bool
    height_class: str
    height: float
    hat_rgb: tuple[float, float, float]
    skin_rgb: tuple[float, float, float]

    def attributes(self) -> tuple:
        return (self.shirt, self.trousers, self.hat, self.height_class)

    def shared_with(self, other: "Appearance") -> int:
        """How many of the four named attributes two people share."""
        return sum(a == b for a, b in zip(self.attributes(), other.attributes()))


def _random_appearance(rng: np.random.Generator, **fixed) -> Appearance:
    shirt = fixed.get("shirt", rng.choice(list(SHIRT_COLORS)))
    trousers = fixed.get("trousers", rng.choice(list(TROUSER_COLORS)))
    hat = fixed.get("hat", bool(rng.random() < 0.35))
    height_class = fixed.get("height_class", rng.choice(list(HEIGHT_CLASSES)))
    lo, hi = HEIGHT_CLASSES[height_class]
    return Appearance(
        shirt=str(shirt),
        trousers=str(trousers),
        hat=bool(hat),
        height_class=str(height_class),
        height=float(rng.uniform(lo, hi)),
        hat_rgb=HAT_COLORS[int(rng.integers(len(HAT_COLORS)))],
        skin_rgb=SKIN_TONES[int(rng.integers(len(SKIN_TONES)))],
    )


def _other_value(rng: np.random.Generator, attr: str, value):
    if attr == "shirt":
        return str(rng.choice([c for c in SHIRT_COLORS if c != value]))
    if attr == "trousers":
        return str(rng.choice([c for c in TROUSER_COLORS if c != value]))
    if attr == "hat":
        return not value
    return str(rng.choice([c for c in HEIGHT_CLASSES if c != value]))


def sample_appearances(rng: np.random.Generator, split: str, n_others: int) -> list[Appearance]:
    """Target first, then ``n_others`` people obeying the split's rules.

    stt: nobody else shares the target's shirt or trouser colour.
    dt: every other person shares at least one but not all of the four attributes.
    at: the first other person is an exact look-alike of the target; the rest are random.
    """
    target = _random_appearance(rng)
    others: list[Appearance] = []
    for k in range(n_others):
        if split == "stt":
            shirt = _other_value(rng, "shirt", target.shirt)
            trousers = _other_value(rng, "trousers", target.trousers)
            others.append(_random_appearance(rng, shirt=shirt, trousers=trousers))
        elif split == "dt":
            # Most distractors share a colour with the target: that is what makes dt hard.
            n_shared = int(rng.choice([1, 2, 3], p=[0.3, 0.4, 0.3]))
            weights = np.array([3.0, 3.0, 1.0, 1.0])
            shared = set(rng.choice(4, size=n_shared, replace=False, p=weights / weights.sum()).tolist())
            values = {}
            for j, attr in enumerate(ATTRIBUTES):
                tv = target.attributes()[j]
                values[attr] = tv if j in shared else _other_value(rng, attr, tv)
            others.append(
                _random_appearance(
                    rng, shirt=values["shirt"], trousers=values["trousers"], hat=values["hat"], height_class=values["height"]
                )
            )
        elif split == "at":
            if k == 0 or rng.random() < 0.2:
                twin = Appearance(**{**target.__dict__})
                others.append(twin)
            else:
                others.append(_random_appearance(rng))
        else:
            raise ValueError(f"unknown split {split!r}")
    return [target, *others]


_VERBS = ("Follow", "Keep following", "Stay behind and follow", "Track and follow")
_AT_PHRASES = (
    "Follow the person in front of you.",
    "Keep following the person who is in front of you.",
    "Follow the person right in front of you.",
    "Track the person standing in front of you and follow them.",
)


def instruction(rng: np.random.Generator, split: str, people: list[Appearance]) -> str:
    """Natural-language instruction naming the target (people[0])."""
    if split == "at":
        return str(_AT_PHRASES[int(rng.integers(len(_AT_PHRASES)))])
    target, others = people[0], people[1:]
    height_word = f"{target.height_class} " if target.height_class != "medium" else ""
    medium_phrase = split == "dt" and target.height_class == "medium" and any(
        o.height_class != "medium" for o in others
    )
    hat_phrase = ""
    if target.hat:
        hat_phrase = " wearing a hat"
    elif split == "dt" and any(o.hat for o in others):
        hat_phrase = " without a hat"
    verb = _VERBS[int(rng.integers(len(_VERBS)))]
    who = f"the {height_word}person"
    if medium_phrase:
        who += " of medium height"
    return f"{verb} {who} in the {target.shirt} shirt and {target.trousers} trousers{hat_phrase}."


def walk(
    start: np.ndarray,
    yaw0: float,
    goals: list[np.ndarray],
    speed: float,
    stops: list[int],
    dt: float,
    turn_rate: float = 1.3,
    accel: float = 1.0,
    initial_wait: int = 0,
    max_ticks: int = 2000,
) -> np.ndarray:
    """Smooth walk through ``goals`` (stop ``stops[i]`` ticks at goal i): poses ``(T, 3)``.

    The heading turns at most ``turn_rate`` rad/s, speed ramps with ``accel`` and slows in
    sharp turns; the walker decelerates to rest before a goal where it stops.
    """
    px, py = float(start[0]), float(start[1])
    yaw = float(yaw0)
    v = 0.0
    max_turn = turn_rate * dt
    dv = accel * dt
    out = [(px, py, yaw)] * (1 + int(initial_wait))
    for goal, stop in zip(goals, stops):
        gx, gy = float(goal[0]), float(goal[1])
        for _ in range(max_ticks):
            ex, ey = gx - px, gy - py
            dist = math.hypot(ex, ey)
            if dist < 0.3 or (stop > 0 and dist < 0.12):
                break
            err = _wrap(math.atan2(ey, ex) - yaw)
            yaw = _wrap(yaw + min(max(err, -max_turn), max_turn))
            v_des = speed * max(0.25, math.cos(err))
            if stop > 0:
                v_des = min(v_des, math.sqrt(2.0 * accel * max(dist - 0.05, 0.0)) + 0.05)
            v += min(max(v_des - v, -dv), dv)
            px += v * dt * math.cos(yaw)
            py += v * dt * math.sin(yaw)
            out.append((px, py, yaw))
            if len(out) > max_ticks:
                break
        if stop > 0:
            v = 0.0
            out.extend([(px, py, yaw)] * int(stop))
    return np.asarray(out, dtype=np.float64)


def _wrap(a: float) -> float:
    return (a + math.pi) % (2.0 * math.pi) - math.pi
