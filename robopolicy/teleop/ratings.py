"""Human-rated episodes: the operator's good / bad mark, and training on the episodes it selects.

``robopolicy teleop`` stores an operator's mark (g / b, or a device's success / failure button)
with the episode: its ``robopolicy/rating`` column is ``good``, ``bad`` or empty (not marked), and
``robopolicy/success`` holds the same mark as true / false. A dataset without the rating column
(an oracle collection, an older recording) is rated by ``robopolicy/success``: the oracle's
outcome, or the mark. Training keeps the episodes of one rating with ``data.rating``::

    robopolicy train --config configs/train/arm/... data.dataset=data/teleop data.rating=good
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

RATINGS = ("good", "bad", "rated", "unrated")
EPISODE_RATING = "robopolicy/rating"  # episode column: "good", "bad" or "" (not marked)


def rating_column(mark: bool | None) -> dict[str, str]:
    """The episode metadata column that stores an operator's mark (True good, False bad, None none)."""
    return {EPISODE_RATING: "" if mark is None else ("good" if mark else "bad")}


def episode_ratings(root: str | Path) -> list[bool | None]:
    """Each committed episode's mark, in episode order: True (good), False (bad), None (unmarked)."""
    from robopolicy.data import features as F
    from robopolicy.data.recorder import read_episodes

    episodes = read_episodes(Path(root))
    if episodes is None:
        return []
    if EPISODE_RATING in episodes.column_names:
        return [{"good": True, "bad": False}.get(v or "") for v in episodes[EPISODE_RATING].to_pylist()]
    if F.EPISODE_SUCCESS not in episodes.column_names:
        return [None] * episodes.num_rows
    return [None if v is None else bool(v) for v in episodes[F.EPISODE_SUCCESS].to_pylist()]


def rated_episodes(root: str | Path, rating: str, episodes: Sequence[int] | None = None) -> list[int]:
    """Indices of the episodes with ``rating`` (good, bad, rated: either mark, unrated: no mark),
    among ``episodes`` when given. Raises ``ValueError`` for an unknown rating or when no episode
    has it (training on nothing is a mistake to name, not an empty run)."""
    if rating not in RATINGS:
        raise ValueError(f"rating must be one of {', '.join(RATINGS)}, got {rating!r}")
    wanted = {"good": (True,), "bad": (False,), "rated": (True, False), "unrated": (None,)}[rating]
    marks = episode_ratings(root)
    pool = range(len(marks)) if episodes is None else [int(e) for e in episodes if 0 <= int(e) < len(marks)]
    keep = [i for i in pool if marks[i] in wanted]
    if not keep:
        counts = {r: sum(m is v for m in marks) for r, v in (("good", True), ("bad", False), ("unmarked", None))}
        raise ValueError(f"{root}: no episode is rated {rating} (of {len(marks)}: {counts['good']} good, "
                         f"{counts['bad']} bad, {counts['unmarked']} unmarked)")
    return keep
