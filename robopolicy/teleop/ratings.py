"""Human-rated episodes: the operator's good / bad mark, and training on the episodes it selects.

``robopolicy teleop`` stores an operator's mark (g / b, or a device's success / failure button)
with the episode: its ``robopolicy/rating`` column is ``good``, ``bad`` or empty (not marked), and
``robopolicy/success`` holds the same mark as true / false. A dataset without the rating column
(an oracle collection, an older recording) is rated by ``robopolicy/success``: the oracle's
outcome, or the mark. Training keeps the episodes of one rating with ``data.rating``::

    robopolicy train --config configs/train/arm/... data.dataset=data/teleop data.rating=good

or conditions on it (success conditioning): with ``model.condition_on_rating: true`` every batch
carries its episode's rating as an index (``RATING_INDEX``: bad 0, good 1, unrated 2), the policy
learns a token for each from good and bad episodes alike, and is asked for ``good`` at inference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

RATINGS = ("good", "bad", "rated", "unrated")
EPISODE_RATING = "robopolicy/rating"  # episode column: "good", "bad" or "" (not marked)
RATING_INDEX = {"bad": 0, "good": 1, "unrated": 2}
"""A rating-conditioned policy's input: the row of its rating embedding for each rating."""


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


def rating_index(rating: Any) -> int:
    """A rating as the conditioned policy's input index: ``good`` / ``bad`` / ``unrated`` (or a
    mark: True, False, None, or an index itself). Raises ``ValueError`` for anything else."""
    if rating is None or rating == "":
        return RATING_INDEX["unrated"]
    if isinstance(rating, (bool, np.bool_)):
        return RATING_INDEX["good" if rating else "bad"]
    if isinstance(rating, (int, np.integer)) and int(rating) in RATING_INDEX.values():
        return int(rating)
    if isinstance(rating, str) and rating in RATING_INDEX:
        return RATING_INDEX[rating]
    raise ValueError(f"a rating is one of {', '.join(RATING_INDEX)} (or its index), got {rating!r}")


def row_ratings(root: str | Path, row_episodes: np.ndarray, episodes: Sequence[int]) -> np.ndarray:
    """Each sample row's rating index ``(N,) int64``, from the episode it belongs to
    (``row_episodes``: the episode index of every row of the training cache). Raises
    ``ValueError`` when none of ``episodes`` (those trained on) carries a mark: a policy
    conditioned on the rating would then only ever see ``unrated``."""
    marks = episode_ratings(root)
    used = [marks[e] for e in episodes if 0 <= int(e) < len(marks)]
    if not any(m is not None for m in used):
        raise ValueError(f"{root}: none of the {len(used)} episodes trained on is rated good or bad (neither a "
                         f"{EPISODE_RATING!r} mark from a teleop session nor a success outcome); conditioning on "
                         f"the rating needs rated episodes (or set it to false)")
    per_episode = np.full(max(len(marks), int(np.max(row_episodes, initial=-1)) + 1), RATING_INDEX["unrated"], np.int64)
    per_episode[: len(marks)] = [rating_index(m) for m in marks]
    return per_episode[np.asarray(row_episodes, dtype=np.int64)]


def with_ratings(batches: Iterable[dict], rows: np.ndarray) -> Iterator[dict]:
    """Training batches with ``rating (B,) int64`` added: the rating index of each sample's episode,
    looked up by the sample's cache row (``index``) in ``rows`` (from :func:`row_ratings`)."""
    import torch

    table = torch.from_numpy(np.asarray(rows, dtype=np.int64))
    for batch in batches:
        batch["rating"] = table[batch["index"].long().cpu()]
        yield batch
