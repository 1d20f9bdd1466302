"""load_policy: one loader for every checkpoint, dispatching on the ``type`` its config.yaml names."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from robopolicy.models import load_policy
from robopolicy.models.encoders import EncoderConfig
from robopolicy.models.language import LanguageConfig
from robopolicy.models.loading import checkpoint_type, register_policy_type
from robopolicy.models.policy import Policy, PolicyConfig, PolicyError

ROOT = Path(__file__).resolve().parents[1]


def state_policy(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    cfg = PolicyConfig(head="chunk_l1", cameras=[], encoders=[EncoderConfig(name="test_resnet", image_size=32)],
                       grid=2, context_strides=[0], horizon=4, language=LanguageConfig(enabled=False), d_model=16,
                       n_heads=2, n_layers=1, head_layers=1, action_shape=[2], state_dim=3, frame_size=[32, 32])
    entry = {"mean": 0.0, "std": 1.0, "min": -1.0, "max": 1.0, "q01": -1.0, "q99": 1.0}
    stats = {"action": {k: np.full(2, v, np.float32) for k, v in entry.items()},
             "observation.state": {k: np.full(3, v, np.float32) for k, v in entry.items()}}
    return Policy(cfg, stats).eval()


def obs(b: int = 2) -> dict:
    return {"observation.state": np.random.default_rng(0).normal(size=(b, 3)).astype(np.float32)}


def test_plain_policy_checkpoint_names_its_type_and_loads(tmp_path):
    policy = state_policy()
    ckpt = policy.save(tmp_path / "p")
    assert yaml.safe_load((ckpt / "config.yaml").read_text())["type"] == "policy"
    assert checkpoint_type(ckpt) == "policy"
    loaded = load_policy(ckpt)
    assert isinstance(loaded, Policy) and torch.allclose(loaded.predict(obs()), policy.predict(obs()))
    # a checkpoint saved before types were written: config.yaml without ``type``
    data = yaml.safe_load((ckpt / "config.yaml").read_text())
    del data["type"]
    (ckpt / "config.yaml").write_text(yaml.safe_dump(data))
    assert checkpoint_type(ckpt) == "policy" and isinstance(load_policy(ckpt), Policy)


def test_residual_checkpoint_dispatches_on_type_and_old_layout_still_loads(tmp_path):
    from robopolicy.refine.residual import ResidualConfig, ResidualPolicy

    base = state_policy()
    policy = ResidualPolicy(ResidualConfig(inputs=["state", "base_action"]), [-1, -1], [1, 1], base=base, state_dim=3)
    ckpt = policy.save(tmp_path / "res")
    assert checkpoint_type(ckpt) == "residual" and checkpoint_type(ckpt / "base") == "policy"
    assert isinstance(load_policy(ckpt), ResidualPolicy)
    with pytest.raises(PolicyError, match="'residual' checkpoint, not a plain policy"):
        Policy.load(ckpt)
    # the layout before types: residual.yaml, no top-level config.yaml
    meta = yaml.safe_load((ckpt / "config.yaml").read_text())
    del meta["type"]
    (ckpt / "residual.yaml").write_text(yaml.safe_dump(meta))
    (ckpt / "config.yaml").unlink()
    assert checkpoint_type(ckpt) == "residual" and isinstance(load_policy(ckpt), ResidualPolicy)


def test_unknown_or_missing_checkpoints_are_named(tmp_path):
    with pytest.raises(PolicyError, match="not found"):
        load_policy(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PolicyError, match="config.yaml is missing"):
        load_policy(tmp_path / "empty")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.yaml").write_text("type: hypernet\n")
    with pytest.raises(PolicyError, match="unknown checkpoint type 'hypernet' .*known: modular, planned, policy, residual"):
        load_policy(tmp_path / "odd")
    with pytest.raises(ValueError, match="not 'module:Class'"):
        register_policy_type("hypernet", "nowhere.Hypernet")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", ["deploy", "eval"])
def test_deploy_and_eval_import_nothing_from_refine(package):
    """Deployment and evaluation load any checkpoint through robopolicy.models, never refine
    (at module level or inside a function)."""
    offending = {str(p.relative_to(ROOT)): sorted(m for m in _imported_modules(p) if m.startswith("robopolicy.refine"))
                 for p in sorted((ROOT / "robopolicy" / package).rglob("*.py"))}
    assert not {k: v for k, v in offending.items() if v}
