from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from robopolicy.config import ConfigError, load_config, parse_overrides
from robopolicy.envs import EnvConfig


@dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass
class Cfg:
    env: EnvConfig = field(default_factory=EnvConfig)
    optim: Optim = field(default_factory=Optim)
    steps: int = 10
    mode: Literal["a", "b"] = "a"
    name: str | None = None
    tags: list[str] = field(default_factory=list)


def test_yaml_plus_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("steps: 5\noptim: {lr: 0.01}\nenv: {id: robopolicy/ArmReach-v0}\n")
    cfg = load_config(Cfg, f, ["optim.lr=3e-4", "env.kwargs.split=dt", "tags=[x, y]", "mode=b"])
    assert cfg.steps == 5
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.optim.betas == (0.9, 0.999)
    assert cfg.env.id == "robopolicy/ArmReach-v0" and cfg.env.kwargs == {"split": "dt"}
    assert cfg.tags == ["x", "y"] and cfg.mode == "b"


def test_int_is_accepted_for_float_but_not_the_reverse():
    assert load_config(Cfg, None, ["optim.lr=1"]).optim.lr == 1.0
    with pytest.raises(ConfigError, match="'steps' expects an integer"):
        load_config(Cfg, None, ["steps=2.5"])


@pytest.mark.parametrize(
    "override, message",
    [
        (["optim.lrr=1"], "unknown key 'optim.lrr'"),
        (["stepz=3"], "unknown key 'stepz'"),
        (["mode=c"], "'mode' must be one of"),
        (["optim=3"], "'optim' must be a mapping"),
        (["optim.betas=[1, 2, 3]"], "expects 2 items"),
        (["noequals"], "must look like key=value"),
        (["name=[1]"], "'name' expects"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(Cfg, None, override)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(Cfg, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(Cfg, bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(Cfg, scalar)
    typo = tmp_path / "typo.yaml"
    typo.write_text("env: {idd: x}\n")
    with pytest.raises(ConfigError, match=r"typo.yaml.*unknown key 'env.idd'"):
        load_config(Cfg, typo)


def test_parse_overrides_values_are_yaml():
    assert parse_overrides(["a.b=3", "a.c=true", "d=hello", "e=", "f=[1, 2]"]) == {
        "a": {"b": 3, "c": True}, "d": "hello", "e": None, "f": [1, 2]}


def test_shipped_configs_load():
    from pathlib import Path

    from robopolicy.commands.sim import SimDemoConfig, SimViewConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    demo = load_config(SimDemoConfig, root / "sim" / "demo.yaml")
    assert len(demo.tasks) >= 4
    load_config(SimViewConfig, root / "sim" / "view.yaml")
    for f in sorted((root / "envs").glob("*.yaml")):
        load_config(EnvConfig, f)


def test_shipped_eval_configs_load_and_name_envs_that_exist():
    """Every ``configs/eval/*.yaml`` is a valid EvalConfig whose env id resolves (the eval help
    points at one of them)."""
    import re

    from robopolicy.commands import eval as eval_cmd
    from robopolicy.envs import resolve_env_id
    from robopolicy.eval.config import EvalConfig

    root = Path(__file__).resolve().parents[1]
    files = sorted((root / "configs" / "eval").glob("*.yaml"))
    assert files
    for f in files:
        resolve_env_id(load_config(EvalConfig, f).env.id)
    named_in_help = re.findall(r"configs/eval/[\w./-]+\.yaml", eval_cmd.__doc__ + str(eval_cmd.add_parser.__code__.co_consts))
    assert named_in_help
    for named in named_in_help:
        assert (root / named).is_file(), named


def test_shipped_refine_configs_load_into_their_methods_config():
    """Every ``configs/refine/<method>/*.yaml`` is a valid config of the method its folder names,
    so a key renamed in code (or mistyped in a config) fails here rather than in a long run."""
    from pathlib import Path

    from robopolicy.commands.refine import config_class

    methods = {"residual_ppo": "residual-ppo", "ppo": "ppo", "residual_td3": "residual-td3",
               "dagger": "dagger", "hg_dagger": "hg-dagger", "rpd": "rpd",
               "world_model": "world-model", "distill": "distill"}
    root = Path(__file__).resolve().parents[1] / "configs" / "refine"
    assert not list(root.glob("*.yaml")), "a refine config sits outside its method's folder"
    assert sorted(d.name for d in root.iterdir() if d.is_dir()) == sorted(methods)
    files = sorted(root.glob("*/*.yaml"))
    assert len(files) >= 10
    for f in files:
        load_config(config_class(methods[f.parent.name]), f)


def test_shipped_train_configs_load_into_the_train_config():
    """Every ``configs/train/<task>/*.yaml`` is a valid ``TrainConfig`` (keys, types, choices), so
    a renamed option or a mistyped key fails here rather than after a dataset is collected."""
    from pathlib import Path

    from robopolicy.train.trainer import TrainConfig

    root = Path(__file__).resolve().parents[1] / "configs" / "train"
    assert not list(root.glob("*.yaml")), "a train config sits outside its task's folder"
    files = sorted(root.glob("*/*.yaml"))
    assert len(files) >= 5
    for f in files:
        cfg = load_config(TrainConfig, f)
        assert cfg.steps > 0, f.name
    fr = load_config(TrainConfig, root / "track" / "stage2_ground_free_run.yaml")
    assert "free_run" in fr.model.aux_heads and fr.loss.ground_free_run > 0


@dataclass
class Run:
    out: str = "outputs/run"
    seed: int = 0


def test_renamed_key_loads_with_a_warning_naming_the_new_key(tmp_path):
    from robopolicy.config import current_key

    with pytest.warns(FutureWarning, match="'out_dir' is deprecated, use 'out'"):
        assert load_config(Run, None, ["out_dir=x"]).out == "x"
    with pytest.raises(ConfigError, match="keep only 'out'"):
        load_config(Run, None, ["out_dir=x", "out=y"])
    assert current_key(Run, "out") == "out"

    @dataclass
    class Old:
        out_dir: str = "o"

    assert current_key(Old, "out") == "out_dir"  # a class that still has the old field keeps it
    assert load_config(Old, None, ["out=z"]).out_dir == "z"  # and takes the one name too


def test_cli_takes_dashed_overrides_and_names_unknown_arguments(tmp_path, capsys):
    from robopolicy.cli import split_overrides

    assert split_overrides(["--steps=5", "seed=1", "--data.features.labels=[]"], True) == (
        ["steps=5", "seed=1", "data.features.labels=[]"], [])
    assert split_overrides(["--verbose", "x"], True) == ([], ["--verbose", "x"])
    assert split_overrides(["--steps=5"], False) == ([], ["steps=5"])


def test_module_env_ids_import_their_module_and_plain_unknown_ids_say_how(tmp_path, monkeypatch):
    import sys

    import gymnasium

    from robopolicy.envs import make_env, resolve_env_id

    pkg = tmp_path / "outside_pkg_envs.py"
    pkg.write_text("import gymnasium\n"
                   "gymnasium.register('outside/Flat-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "outside/Flat-v0" not in gymnasium.registry
    with pytest.raises(ConfigError, match="module:EnvId"):
        resolve_env_id("outside/Flat-v0")
    env = make_env(EnvConfig(id="outside_pkg_envs:outside/Flat-v0"), render_mode=None)
    assert "outside_pkg_envs" in sys.modules and env.observation_space.shape == (4,)
    env.close()
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        resolve_env_id("no_such_module:Thing-v0")
    with pytest.raises(ConfigError, match="did not register it"):
        resolve_env_id("outside_pkg_envs:outside/Other-v0")
    del gymnasium.registry["outside/Flat-v0"]


def test_eval_output_is_unique_per_checkpoint(tmp_path):
    from robopolicy.commands.eval import default_out

    a, b = default_out("outputs/train/arm/final"), default_out("outputs/train/track/final")
    assert a.parent.as_posix() == "outputs/eval" and a.name.startswith("arm-final-")
    assert a != b and default_out("outputs/refine/arm/final") != a
    assert default_out("runs/x/checkpoints/step_000500").name.startswith("x-checkpoints-step_000500-")
    assert default_out("outputs/train/arm/final") == a  # stable


def test_the_policy_checkpoint_is_checkpoint_in_every_command(tmp_path, capsys):
    from robopolicy.cli import build_parser
    from robopolicy.commands import refine, run

    parser = build_parser()
    args = parser.parse_args(["refine", "--method", "dagger", "--checkpoint", "ck", "--out", "o"])
    assert refine._overrides(args)[:2] == ["base=ck", "out=o"]
    args = parser.parse_args(["refine", "--method", "dagger", "--base", "ck"])  # the old name, still taken
    assert refine._overrides(args)[0] == "base=ck" and "--base is deprecated" in capsys.readouterr().err
    args = parser.parse_args(["refine", "--method", "dagger", "--base", "a", "--checkpoint", "b"])
    with pytest.raises(ConfigError, match="keep --checkpoint"):
        refine._overrides(args)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    robot = str(Path(__file__).resolve().parents[1] / "configs" / "robots" / "sim_arm.yaml")
    args = parser.parse_args(["run", "--robot", robot, "--checkpoint", str(ckpt)])
    assert run.load_run_config(args).policy == str(ckpt)
    args = parser.parse_args(["run", "--robot", robot, "--policy", str(ckpt)])
    assert run.load_run_config(args).policy == str(ckpt) and "use --checkpoint" in capsys.readouterr().err
    args = parser.parse_args(["run", "--checkpoint", str(ckpt), "--policy", "hold"])
    with pytest.raises(ConfigError, match="not both"):
        run.load_run_config(args)
