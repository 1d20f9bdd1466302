"""robopolicy quickstart: collect -> train -> eval end to end at a tiny budget (the real config shape)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from robopolicy.commands.quickstart import DEFAULT_CONFIG, load_quickstart_config, run_quickstart  # noqa: E402
from robopolicy.config import ConfigError  # noqa: E402

TINY = [
    "collect.episodes=2", "collect.workers=1", "collect.image_size=32", "collect.progress=false",
    "collect.env.kwargs.max_steps=60",  # (shorter PersonFollow episodes crash in scenario.py for now)
    "train.steps=3", "train.batch_size=8", "train.log_every=1", "train.progress=false",
    "train.model.d_model=16", "train.model.n_layers=1",  # the config's own encoder: frozen ImageNet Lite0
    "train.model.language.enabled=false",
    "eval.episodes=2", "eval.workers=1", "eval.videos=1", "eval.render_size=48", "eval.progress=false",
]


def test_quickstart_pipeline_end_to_end(tmp_path, capsys):
    out = tmp_path / "qs"
    overrides = [f"out={out}", f"train.data.cache_dir={tmp_path / 'cache'}",
                 f"train.data.feature_cache_dir={tmp_path / 'features'}", *TINY]
    cfg = load_quickstart_config(DEFAULT_CONFIG, overrides)
    numbers = run_quickstart(cfg)
    printed = capsys.readouterr().out
    for stage in ("[1/3] collect", "[2/3] train", "[3/3] evaluate"):
        assert stage in printed
    summary = printed.strip().splitlines()[-1]
    assert summary.startswith("quickstart: PersonFollow-v0[stt] SR ") and "total" in summary

    assert (out / "dataset" / "meta" / "info.json").is_file()
    assert (out / "train" / "final" / "model.safetensors").is_file()
    saved = json.loads((out / "quickstart.json").read_text())
    assert saved["splits"]["stt"]["episodes"] == 2 == numbers["splits"]["stt"]["episodes"]
    assert 0.0 <= saved["splits"]["stt"]["tracking_rate"] <= 1.0
    assert saved["train"]["steps"] == 3
    assert "frozen encoder features:" in printed and saved["timings_s"]["encode_s"] > 0  # cached, once
    files = saved["files"]
    for key in ("eval_table", "metrics_plot", "loss_plot"):
        assert files[key] and os.path.isfile(files[key]), key
    assert len(files["videos"]) == 1 and os.path.getsize(files["videos"][0]) > 0
    assert "| stt | 2 |" in (out / "eval" / "eval.md").read_text()

    # `robopolicy eval` finds the task of a checkpoint through its run's dataset
    from robopolicy.commands.eval import checkpoint_env

    assert checkpoint_env(out / "train" / "final") == {"id": "robopolicy/PersonFollow-v0", "kwargs": {}}

    # a second run reuses the complete dataset instead of collecting again
    run_quickstart(load_quickstart_config(DEFAULT_CONFIG, [*overrides, "train.steps=1", "eval.episodes=1"]))
    assert "dataset already holds 2 episodes: reused" in capsys.readouterr().out


def test_quickstart_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="train.model.hed"):
        load_quickstart_config(DEFAULT_CONFIG, ["train.model.hed=waypoints"])
    with pytest.raises(ConfigError, match="unknown key 'evall'"):
        load_quickstart_config(DEFAULT_CONFIG, ["evall.episodes=3"])
