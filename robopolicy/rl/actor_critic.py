"""A Gaussian actor (optional categorical switch columns) and a critic over standardized inputs.

    ac = ActorCritic(d_in=10, width=6, hidden=[256, 256], log_std=torch.full((6,), -1.0), switch=[5])
    x = ac.norm(raw)                 # (B, d_in) standardized by running statistics
    dist = ac.dist(x)                # ActionDist over samples r (B, width)
    r = dist.sample()                # a switch column holds the chosen setting's index (0, 1, 2)
    logp = dist.log_prob(r, lo, hi)  # (B,): Gaussian columns scored within [lo, hi], plus the switches'

The actor's last layer starts at zero, so an untrained actor's mean is 0 (a residual then
reproduces its base exactly) and each switch starts at its prior.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from robopolicy.rl.normalize import RunningNorm

SWITCH_SETTINGS = 3
"""A switch column's settings: 0 keep, 1 low, 2 high (what they mean is the action adapter's)."""


def mlp(sizes: Sequence[int], zero_last: bool = False) -> nn.Sequential:
    """Linear layers with tanh between them; ``zero_last``: the output layer starts at zero."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    if zero_last:
        nn.init.zeros_(layers[-1].weight)
        nn.init.zeros_(layers[-1].bias)
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    """Input statistics ``norm``, actor ``(B, d_in) → (B, width + 3 S)``, critic ``(B, d_in) → (B,)``
    and the Gaussian's log-std ``(width,)``.

    ``switch``: columns of the sample that are categorical (a setting index) instead of Gaussian;
    ``switch_prob``: each forced setting's initial probability. ``gaussian``: ``(width,)`` 1 where
    a Gaussian column counts in the log-probability (default: every non-switch column); a column
    that moves nothing has no likelihood either. ``chunk``: the Gaussian width is ``chunk`` times
    the log-std's, which every step of the chunk shares."""

    def __init__(self, d_in: int, width: int, hidden: Sequence[int], log_std: torch.Tensor, learn_std: bool = False,
                 switch: Sequence[int] = (), switch_prob: float = 0.02, gaussian: torch.Tensor | None = None,
                 chunk: int = 1):
        super().__init__()
        self.chunk, self.switch, self.learn_std = int(chunk), list(switch), bool(learn_std)
        self.norm = RunningNorm(d_in)
        self.actor = mlp([d_in, *hidden, width + SWITCH_SETTINGS * len(self.switch)], zero_last=True)
        self.critic = mlp([d_in, *hidden, 1])
        self.log_std = nn.Parameter(log_std.float().clone(), requires_grad=learn_std)
        p = switch_prob
        self.register_buffer("switch_prior", torch.log(torch.tensor([1 - 2 * p, p, p])), persistent=False)
        mask = torch.ones(width) if gaussian is None else gaussian.float().clone()
        mask[self.switch] = 0.0
        self.register_buffer("gaussian", mask, persistent=False)

    def dist(self, x: torch.Tensor) -> "ActionDist":
        """The action distribution for standardized inputs ``x (B, d_in)``."""
        out = self.actor(x)
        width = self.gaussian.shape[0]
        std = self.log_std.exp().repeat(self.chunk)
        normal = torch.distributions.Normal(out[:, :width], std.expand(x.shape[0], -1))
        logits = None
        if self.switch:
            logits = out[:, width:].reshape(out.shape[0], len(self.switch), SWITCH_SETTINGS) + self.switch_prior
        return ActionDist(normal, logits, self.switch, self.gaussian)

    def value(self, x: torch.Tensor) -> torch.Tensor:
        """``(B,)`` state values of standardized inputs ``x (B, d_in)``."""
        return self.critic(x).squeeze(-1)

    def trainable_parameters(self) -> dict[str, list[nn.Parameter]]:
        """``{"actor": [...], "critic": [...]}`` (the log-std with the actor when it learns)."""
        actor = list(self.actor.parameters()) + ([self.log_std] if self.learn_std else [])
        return {"actor": actor, "critic": list(self.critic.parameters())}


class ActionDist:
    """A Gaussian over ``(B, W)`` samples and, for each switch column, a categorical over its
    settings with ``logits (B, S, 3)``; a sample ``r (B, W)`` holds the setting's index in a switch
    column. ``gaussian (W,)``: 1 where a Gaussian column counts in :meth:`log_prob`."""

    def __init__(self, normal: torch.distributions.Normal, logits: torch.Tensor | None, switch: Sequence[int],
                 gaussian: torch.Tensor | None = None):
        self.normal, self.logits, self.switch = normal, logits, list(switch)
        self.gaussian = torch.ones(normal.mean.shape[-1]) if gaussian is None else gaussian

    @property
    def mean(self) -> torch.Tensor:
        return self.normal.mean

    @property
    def stddev(self) -> torch.Tensor:
        return self.normal.stddev

    def sample(self, noise: torch.Tensor | None = None) -> torch.Tensor:
        """A sample; ``noise``: standard-normal draws for the Gaussian (``None``: fresh)."""
        r = self.normal.sample() if noise is None else self.normal.mean + self.normal.stddev * noise
        if self.logits is not None:
            r = r.clone()
            r[:, self.switch] = torch.distributions.Categorical(logits=self.logits).sample().float()
        return r

    def mode(self, bound: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The deterministic sample: the Gaussian's mean (passed through ``bound``), the most
        probable setting in each switch column."""
        r = self.normal.mean if bound is None else bound(self.normal.mean)
        if self.logits is not None:
            r = r.clone()
            r[:, self.switch] = self.logits.argmax(-1).float()
        return r

    def switch_log_prob(self, r: torch.Tensor) -> torch.Tensor:
        """``(B,)``: the log-probability of the settings chosen in ``r``'s switch columns (0 without any)."""
        if self.logits is None:
            return torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
        choice = r[:, self.switch].round().long().clamp(0, SWITCH_SETTINGS - 1)
        return torch.distributions.Categorical(logits=self.logits).log_prob(choice).sum(-1)

    def gaussian_log_prob(self, r: torch.Tensor, lo: torch.Tensor | None = None,
                          hi: torch.Tensor | None = None) -> torch.Tensor:
        """``(B,)``: the Gaussian columns' log-likelihood of ``r``.

        ``lo``, ``hi`` ``(B, W)`` (optional): where a sample executes as the bound itself (the
        action box clips it), the clipped-action policy gradient (Fujita & Maeda 2018) scores a
        sample beyond a bound by the probability mass beyond it, ``log P(r >= hi)``, instead of
        its density: with the density, a column the task wants at its bound gives a gradient that
        keeps pushing the mean outward without limit; with the tail mass it vanishes once the mean
        is past the bound. ``±inf`` marks a column without a bound."""
        logp = self.normal.log_prob(r)
        if lo is not None:
            boxed = torch.isfinite(hi) & torch.isfinite(lo)
            # unbounded columns are computed at 0 and discarded: an infinite (or far) bound's tail is
            # not safe, log_ndtr's float32 gradient there is NaN for some arguments, and torch.where
            # passes a discarded branch's NaN on (0 * NaN)
            hi_, lo_ = torch.where(boxed, hi, 0.0), torch.where(boxed, lo, 0.0)
            mu, std = self.mean, self.stddev
            upper = torch.special.log_ndtr(torch.where(boxed, (mu - hi_) / std, 0.0))  # log P(sample >= hi)
            lower = torch.special.log_ndtr(torch.where(boxed, (lo_ - mu) / std, 0.0))  # log P(sample <= lo)
            hi, lo = torch.where(boxed, hi, torch.inf), torch.where(boxed, lo, -torch.inf)
            logp = torch.where(r >= hi, upper, torch.where(r <= lo, lower, logp))
        return torch.where(self.gaussian > 0, logp, 0.0).sum(-1)

    def log_prob(self, r: torch.Tensor, lo: torch.Tensor | None = None, hi: torch.Tensor | None = None) -> torch.Tensor:
        """``(B,)``: the Gaussian columns' log-likelihood (see :meth:`gaussian_log_prob`) plus the
        switch columns' log-probability."""
        return self.gaussian_log_prob(r, lo, hi) + self.switch_log_prob(r)
