"""Perceive, then act: a locator estimates the scene state that a state-based actor reads.

    policy = ModularPolicy(locator=Policy.load("outputs/train/arm_locator/final"),
                           actor=Policy.load("outputs/train/arm_actor/final"))
    chunk = policy.predict(obs)     # obs: camera frames, joint state, instruction; (B, H, A) out
    policy.save("outputs/train/arm_actor/final")
    policy = ModularPolicy.load(...)            # or robopolicy.models.load_policy(...)

- ``locator``: a camera :class:`~robopolicy.models.policy.Policy` with a ``locate`` head (trained
  on a privileged label, e.g. ``label.goal_pos``: the named cube's and bowl's xyz), FiLM-conditioned
  on the instruction. Its :meth:`Policy.locate` turns the frames into ``(B, D)`` estimates.
- ``actor``: a :class:`Policy` trained by imitation on the joint state and that same label as
  its scene state (``data.features.env_state: label.goal_pos``, ``env_state_dim == D``).

At inference the estimate takes the place of ``observation.environment_state``; a scene state
in the observation is ignored, so the policy needs only what a robot has (cameras, joints and
the instruction). Each half trains on its own data: the actor on demonstrations, the locator
on any labelled frames (oracle episodes, rendered layouts), and the estimate's error is what
the actor must tolerate. The checkpoint is one
directory: ``config.yaml`` (``type: modular``) plus ``locator/`` and ``actor/``, each a plain
policy checkpoint (one saved before types were written has ``modular.yaml`` instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from robopolicy.data.features import ENV_STATE
from robopolicy.models.policy import CONFIG_FILE, Policy, PolicyError
from robopolicy.utils.files import atomic_directory

MODULAR_CONFIG = "modular.yaml"  # the descriptor of a checkpoint saved before ``config.yaml`` named its type
LOCATOR_DIR = "locator"
ACTOR_DIR = "actor"
MODULAR_FORMAT = 1


@dataclass
class ModularView:
    """What evaluation and deployment read from a policy's ``config``: the locator's cameras and
    frame size, the actor's head; ``env_state_dim`` 0 because no privileged state is read."""

    head: str
    cameras: list[str] = field(default_factory=list)
    frame_size: list[int] = field(default_factory=list)
    context_strides: list[int] = field(default_factory=lambda: [0])
    env_state_dim: int = 0


class ModularPolicy(nn.Module):
    """``locator`` (frames → scene-state estimate) then ``actor`` (joint state + estimate → chunk)."""

    def __init__(self, locator: Policy, actor: Policy):
        super().__init__()
        if "locate" not in locator.aux:
            raise PolicyError("modular policy: the locator has no locate head (model.aux_heads: [locate])")
        if not locator.cameras:
            raise PolicyError("modular policy: the locator has no camera")
        dim = locator.config.locate_dim
        if actor.config.env_state_dim != dim:
            raise PolicyError(f"modular policy: the locator estimates {dim} values, the actor reads a scene "
                              f"state of {actor.config.env_state_dim} (train it with data.features.env_state "
                              f"set to the locator's label)")
        if actor.config.state_dim and locator.config.state_dim and actor.config.state_dim != locator.config.state_dim:
            raise PolicyError(f"modular policy: the locator reads {locator.config.state_dim} joint values, "
                              f"the actor {actor.config.state_dim}")
        self.locator, self.actor = locator, actor
        strides = sorted(set(locator.config.context_strides) | set(actor.config.context_strides))
        self.config = ModularView(head=actor.config.head, cameras=list(locator.cameras),
                                  frame_size=list(locator.config.frame_size), context_strides=strides)

    # the surface evaluation and deployment use
    @property
    def output(self) -> str:
        return self.actor.output

    @property
    def horizon(self) -> int:
        return self.actor.horizon

    @property
    def cameras(self) -> list[str]:
        return self.locator.cameras

    @property
    def language(self):
        return self.locator.language

    def reset(self, rows: Sequence[int] | None = None) -> None:
        self.locator.reset(rows)
        self.actor.reset(rows)

    def observe(self, obs: Mapping[str, Any]) -> None:
        self.locator.observe(obs)
        self.actor.observe(obs)

    def estimate(self, obs: Mapping[str, Any]) -> torch.Tensor:
        """The locator's scene-state estimate ``(B, D)`` for this observation (pushes the frame)."""
        return self.locator.locate(obs)

    def predict(self, obs: Mapping[str, Any], flow_steps: int | None = None) -> torch.Tensor:
        """Observation batch (frames, joint state, instruction) → ``(B, H, A)`` chunk in env units."""
        inner = {k: v for k, v in obs.items() if k != ENV_STATE}
        inner[ENV_STATE] = self.estimate(obs).numpy()
        return self.actor.predict(inner, flow_steps=flow_steps)

    # checkpoints
    def save(self, directory: str | Path) -> Path:
        import yaml

        directory = Path(directory)
        with atomic_directory(directory) as tmp:
            self.locator.save(tmp / LOCATOR_DIR)
            self.actor.save(tmp / ACTOR_DIR)
            (tmp / CONFIG_FILE).write_text(yaml.safe_dump(
                {"format": MODULAR_FORMAT, "type": "modular", "locator": LOCATOR_DIR, "actor": ACTOR_DIR},
                sort_keys=False))
        return directory

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device = "cpu") -> "ModularPolicy":
        from robopolicy.models.loading import read_typed_config

        directory = Path(directory)
        meta_path, meta = read_typed_config(directory, "modular", MODULAR_CONFIG)
        if meta.get("format") != MODULAR_FORMAT:
            raise PolicyError(f"{meta_path}: unknown modular checkpoint format {meta.get('format')!r}")
        parts = {}
        for role, default in (("locator", LOCATOR_DIR), ("actor", ACTOR_DIR)):
            sub = directory / str(meta.get(role) or default)
            if not sub.is_dir():
                raise PolicyError(f"{directory} is a modular checkpoint but its {role} is missing (expected {sub})")
            parts[role] = Policy.load(sub, device)
        return cls(parts["locator"], parts["actor"]).to(device).eval()
