"""Episodes a world model learns from: a LeRobot dataset of ours, plus rollouts added while it runs.

    eps = read_episodes("outputs/datasets/point")          # observation.state, action, next.reward, next.success
    eps.add(obs, actions, rewards, successes)              # a new rollout (obs has T + 1 rows: the last is known)
    batch = eps.sample(256, horizon=8, rng=rng)            # windows of horizon steps, masked past the episode end

A window ``(B, H)``: ``obs (B, H + 1, D)``, ``action (B, H, A)``, ``reward (B, H)``, ``success (B, H)``
(success after step k), ``valid (B, H)`` (step k is inside the episode), ``next_known (B, H)`` (the
observation after step k is known: a dataset's last frame has none).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from robopolicy.data.cache import _read_parquet, read_dataset
from robopolicy.data.errors import DatasetError
from robopolicy.world.model import WorldModelError

NEEDED = {"observation.state": "the state the model encodes", "action": "the action its dynamics take",
          "next.reward": "the reward head's target"}
SUCCESS_KEYS = ("next.success", "next.done")
"""The success/termination head's target: the first of these a dataset has."""


class Episodes:
    """Episodes of state, action, reward and success, sampled as fixed-horizon windows."""

    def __init__(self, obs_dim: int, act_dim: int):
        self.obs_dim, self.act_dim = int(obs_dim), int(act_dim)
        self.obs: list[np.ndarray] = []  # (T + 1, D) each; the last row repeats when unknown
        self.steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # action (T, A), reward (T,), success (T,)
        self.final_known: list[bool] = []
        self._flat: tuple | None = None

    def __len__(self) -> int:
        return len(self.obs)

    @property
    def num_steps(self) -> int:
        return sum(len(s[1]) for s in self.steps)

    def add(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, successes: np.ndarray) -> None:
        """One episode: ``obs (T + 1, D)`` (or ``(T, D)`` when the last next observation is unknown),
        ``actions (T, A)``, ``rewards (T,)``, ``successes (T,)``."""
        obs, actions = np.asarray(obs, np.float32), np.asarray(actions, np.float32)
        T = len(actions)
        if T == 0:
            return
        if obs.ndim != 2 or obs.shape[1] != self.obs_dim or actions.shape[1:] != (self.act_dim,):
            raise WorldModelError(f"episode of obs {obs.shape} and actions {actions.shape} does not match "
                                  f"state size {self.obs_dim} and action size {self.act_dim}")
        if len(obs) not in (T, T + 1):
            raise WorldModelError(f"episode has {len(obs)} observations for {T} actions (expected T or T + 1)")
        known = len(obs) == T + 1
        self.obs.append(obs if known else np.concatenate([obs, obs[-1:]]))
        self.steps.append((actions, np.asarray(rewards, np.float32).reshape(T),
                           np.asarray(successes, np.float32).reshape(T)))
        self.final_known.append(known)
        self._flat = None

    def start_states(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` observed states drawn uniformly from every step: ``(n, D)``."""
        step_obs = np.concatenate([o[:-1] for o in self.obs])
        return step_obs[rng.integers(0, len(step_obs), n)]

    def _arrays(self):
        if self._flat is None:
            lengths = np.array([len(s[1]) for s in self.steps])
            step_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            obs_start = step_start + np.arange(len(lengths))
            self._flat = (np.concatenate(self.obs), np.concatenate([s[0] for s in self.steps]),
                          np.concatenate([s[1] for s in self.steps]), np.concatenate([s[2] for s in self.steps]),
                          lengths, step_start, obs_start, np.array(self.final_known))
        return self._flat

    def sample(self, batch: int, horizon: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """``batch`` windows of ``horizon`` steps starting at uniformly drawn steps (see the module docstring)."""
        if not self.obs:
            raise WorldModelError("no episodes to sample from")
        obs, act, rew, suc, lengths, step_start, obs_start, final_known = self._arrays()
        g = rng.integers(0, int(lengths.sum()), batch)
        e = np.searchsorted(step_start, g, side="right") - 1
        t = g - step_start[e]
        k = np.arange(horizon)
        tt = t[:, None] + k[None]  # (B, H)
        T = lengths[e][:, None]
        valid = tt < T
        steps = step_start[e][:, None] + np.minimum(tt, T - 1)
        obs_idx = obs_start[e][:, None] + np.minimum(t[:, None] + np.arange(horizon + 1)[None], T)
        next_known = valid & ((tt < T - 1) | final_known[e][:, None])
        return {"obs": obs[obs_idx], "action": act[steps], "reward": rew[steps] * valid,
                "success": suc[steps] * valid, "valid": valid.astype(np.float32),
                "next_known": next_known.astype(np.float32)}

    def split(self, fraction: float, rng: np.random.Generator) -> tuple["Episodes", "Episodes"]:
        """``(kept, held out)``: a ``fraction`` of the episodes (at least one when there are two) held out."""
        order = rng.permutation(len(self))
        n_out = min(len(self) - 1, max(1, int(round(fraction * len(self))))) if fraction > 0 and len(self) > 1 else 0
        parts = (Episodes(self.obs_dim, self.act_dim), Episodes(self.obs_dim, self.act_dim))
        for rank, i in enumerate(order):
            a, r, s = self.steps[i]
            o = self.obs[i] if self.final_known[i] else self.obs[i][:-1]
            parts[int(rank < n_out)].add(o, a, r, s)
        return parts


def read_episodes(root: str | Path) -> Episodes:
    """The episodes of a LeRobot v3 dataset; a missing key is a :class:`WorldModelError` that names it."""
    try:
        src = read_dataset(root)
    except DatasetError as exc:
        raise WorldModelError(str(exc)) from None
    missing = [f"{k} ({why})" for k, why in NEEDED.items() if k not in src.features]
    success_key = next((k for k in SUCCESS_KEYS if k in src.features), None)
    if success_key is None:
        missing.append(f"{' or '.join(SUCCESS_KEYS)} (the success/termination head's target)")
    if missing:
        raise WorldModelError(f"{root}: dataset lacks {', '.join(missing)}; a world model needs state, action, "
                              "reward and success (datasets from `robopolicy collect` have them)")
    cols = [*NEEDED, success_key, "episode_index", "frame_index"]
    import pyarrow as pa

    table = pa.concat_tables([_read_parquet(p, cols) for p in src.data_files]).to_pandas()
    table = table.sort_values(["episode_index", "frame_index"])
    obs_dim = int(np.prod(src.features["observation.state"]["shape"]))
    act_dim = int(np.prod(src.features["action"]["shape"]))
    eps = Episodes(obs_dim, act_dim)
    for _, ep in table.groupby("episode_index", sort=True):
        flat = lambda key, d: np.stack([np.asarray(v, np.float32).reshape(d) for v in ep[key]])  # noqa: E731
        eps.add(flat("observation.state", obs_dim), flat("action", act_dim), flat("next.reward", 1)[:, 0],
                flat(success_key, 1)[:, 0])
    if not len(eps):
        raise WorldModelError(f"{root}: dataset has no frames")
    return eps
