"""The command lines explain themselves: --help prints every config field with its value and comment
(exit 0) for every entry point; a missing config file and a misspelled override are one `error:` line
(exit 2), before anything is parsed, loaded or written."""

import os
import re
import subprocess
import sys

import pytest
from test_trainer import REPO

from ppo_jax.cli import common, config_help
from ppo_jax.config import ConfigError, config_dict
from ppo_jax.config_file import check_overrides, load_config
from ppo_jax.demo.settings import DemoSettings
from ppo_jax.rl.settings import Settings
from ppo_jax.supervised.settings import DPOSettings, RewardModelSettings, SFTSettings

TOY = f"{REPO}/configs/ppo_toy.py"


def _help(capsys, schema, config_file, what="PPO"):
    with pytest.raises(SystemExit) as exit_info:
        common.preflight(["prog", f"--config={config_file}", "--help"], what=what, schema=schema,
                         default_config=None, takes_workdir=True)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_field_with_the_config_files_value_and_its_comment(capsys):
    out = _help(capsys, Settings, TOY)
    lines = out.splitlines()
    # Every leaf of the config appears once, as an override that works.
    config = load_config(TOY)
    leaves = [name for name, _, _ in config_help._rows(config, Settings, "")]
    assert len(leaves) > 60
    for name in leaves:
        assert sum(line.strip().startswith(f"--config.{name}=") for line in lines) == 1, name
    # The value is the config file's (30, not the schema default 20), the comment the schema's.
    assert any(line.strip().startswith("--config.train.iterations=30") and
               line.endswith("# PPO iterations (rollout + update)") for line in lines)
    assert "--workdir=DIR" in out and "--verbose" in out


@pytest.mark.parametrize("schema,config_file,field", [
    (SFTSettings, "configs/sft.py", "--config.train.steps="),
    (RewardModelSettings, "configs/reward_model.py", "--config.data.chosen_field="),
    (DPOSettings, "configs/dpo.py", "--config.loss.beta=0.1 "),
    (DemoSettings, "ppo_jax/demo/default_config.py", "--config.sft.train.steps=800"),
])
def test_help_of_the_other_trainers(capsys, schema, config_file, field):
    out = _help(capsys, schema, f"{REPO}/{config_file}", what="x")
    assert field in out


def test_every_config_field_has_a_comment():
    """The --help text is the schema's comments: a field without one would print bare."""
    for schema in (Settings, SFTSettings, RewardModelSettings, DPOSettings, DemoSettings):
        bare = [name for name, _, comment in config_help._rows(config_dict(schema()), schema, "")
                if not comment and ".model." not in f".{name}"]
        assert not bare, f"{schema.__name__} fields without a comment: {bare}"


@pytest.mark.parametrize("override,message", [
    ("--config.train.iteratons=3", "unknown config field --config.train.iteratons: train has no field 'iteratons'; "
                                   "did you mean --config.train.iterations?"),
    ("--config.trian.iterations=3", "the config has no field 'trian'; did you mean --config.train?"),
    ("--config.seed.x=1", "--config.seed.x: seed is a value, not a section"),
    ("--config.rollout.zzz=1", "rollout has no field 'zzz'; rollout has batch_size, "),
])
def test_a_misspelled_override_is_named_with_a_suggestion(override, message):
    config = load_config(TOY)
    with pytest.raises(ConfigError, match=None) as info:
        check_overrides(["--workdir=x", override], config)
    assert message in str(info.value)
    check_overrides(["--config.train.iterations=3", "--config.policy.model.num_layers", "4"], config)


@pytest.mark.parametrize("schema,example", [
    (SFTSettings, "configs/sft.py"), (RewardModelSettings, "configs/reward_model.py"), (DPOSettings, "configs/dpo.py"),
])
def test_help_without_a_config_suggests_the_trainers_own_and_lists_its_defaults(capsys, schema, example):
    with pytest.raises(SystemExit) as exit_info:
        common.preflight(["prog", "--help"], what="x", schema=schema, default_config=None, takes_workdir=True,
                         example_config=example)
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert f"--config=FILE is required, e.g. --config={example}" in out and "ppo_toy" not in out
    defaults = [name for name, _, _ in config_help._rows(config_dict(schema()), schema, "")]
    assert all(f"--config.{name}=" in out for name in defaults) and "with its value in the defaults" in out
    with pytest.raises(ConfigError, match=f"e.g. {example}"):
        load_config("nope.py", example=example)


def test_plan_help_names_the_planner():
    """Its --help says what it is and lists its own flags with or without a config (the subprocess test
    above runs the real entry point; this one is the text)."""
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.plan", "--help"], capture_output=True, text=True,
                         timeout=300).stdout
    assert out.startswith("--config=FILE is required, e.g. --config=configs/plan_tinyllama.py")
    assert "PPO memory plan" in out and "PPO run" not in out and "--tpu_topology" in out


@pytest.mark.parametrize("override,message", [
    ("--config.rollout.batch_size=abc", "--config.rollout.batch_size=abc: rollout.batch_size takes a whole number (now 32)"),
    ("--config.ppo.clip_eps=x", "ppo.clip_eps takes a number (now 0.2)"),
    ("--config.train.progress=maybe", "train.progress takes true or false (now True)"),
    ("--config.mesh.shape=(1,", "mesh.shape takes a tuple"),
])
def test_a_value_of_the_wrong_type_is_named(override, message):
    config = load_config(TOY)
    with pytest.raises(ConfigError) as info:
        check_overrides([override], config)
    assert message in str(info.value)
    with pytest.raises(ConfigError, match="rollout.batch_size takes a whole number"):
        check_overrides(["--config.rollout.batch_size", "1.5"], config)
    # Values of the right type, a bool flag without a value, a field of an unset section: accepted.
    check_overrides(["--config.rollout.batch_size=8", "--config.ppo.clip_eps=1e-1", "--config.train.progress",
                               "--config.mesh.shape=(2,-1,1)", "--config.train.progress=false"], config)


def test_a_wrong_type_from_the_command_line_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.train", f"--config={TOY}", f"--workdir={tmp_path}/run",
                          "--config.rollout.batch_size=abc"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr == ("error: --config.rollout.batch_size=abc: rollout.batch_size takes "
                                                  "a whole number (now 32)\n"), out.stderr
    assert not (tmp_path / "run").exists()


def test_a_misplaced_field_suggests_its_full_path():
    config = load_config(f"{REPO}/ppo_jax/demo/default_config.py")
    with pytest.raises(ConfigError, match=r"did you mean --config\.ppo\.ppo\.kl_coef\?"):
        check_overrides(["--config.ppo.kl_coef=0.1"], config)


@pytest.mark.parametrize("schema,field,message", [
    (Settings, "policy.path", "policy.path='{p}' does not exist: it should be a Hugging Face model directory"),
    (Settings, "reward.path", "reward.path='{p}' does not exist: it should be a Hugging Face ForSequenceClassification"),
    (Settings, "policy.lora.init_from", "policy.lora.init_from='{p}' does not exist: it should be a PEFT LoRA adapter"),
    (SFTSettings, "model.path", "sft: model.path='{p}' does not exist: it should be a Hugging Face model directory"),
    (RewardModelSettings, "tokenizer_path", "reward_model: tokenizer_path='{p}' does not exist: it should be a "
                                            "Hugging Face tokenizer directory"),
    (DPOSettings, "model.path", "dpo: model.path='{p}' does not exist"),
])
def test_a_missing_model_path_names_its_field(tmp_path, schema, field, message):
    config = config_dict(schema())
    missing = str(tmp_path / "nowhere")
    *sections, name = field.split(".")
    section = config
    for part in sections:
        section = section[part]
    section[name] = missing
    if schema is Settings:
        config.reward.functions = "toy_target_count"
    with pytest.raises(ConfigError) as info:
        schema.from_config(config)
    assert message.format(p=missing) in str(info.value)


def test_a_missing_config_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"config file '.*nope.py' does not exist"):
        load_config(str(tmp_path / "nope.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(:\n")
    with pytest.raises(ConfigError, match="broken.py' failed to load: SyntaxError"):
        load_config(str(broken))


# What each console script's --help must name: its own flags (and the planner says what it is).
CONSOLE_SCRIPT_HELP = {
    "ppo-jax-train": ["--config=FILE", "--workdir=DIR", "PPO run", "--config.ppo.kl_coef"],
    "ppo-jax-sft": ["--config=FILE", "--workdir=DIR", "SFT run"],
    "ppo-jax-reward-model": ["--config=FILE", "--workdir=DIR", "reward-model run"],
    "ppo-jax-dpo": ["--config=FILE", "--workdir=DIR", "DPO run"],
    "ppo-jax-export": ["--checkpoint: PPO workdir", "--out:", "--which:", "--lora:"],
    "ppo-jax-plan": ["--config=FILE", "PPO memory plan", "--device_memory_gb", "--tpu_topology", "--num_devices"],
    "ppo-jax-demo": ["--config=FILE", "--workdir=DIR", "demo run", "--config.world.p_ramble"],
    "ppo-jax-sweep": ["--trainer:", "--sweep_dir:", "--grid:", "--parallel:", "--seeds:"],
}


def test_every_console_script_has_its_help_listed_here():
    scripts = re.findall(r'"(ppo-jax-[\w-]+)=', open(f"{REPO}/setup.py").read())
    assert sorted(scripts) == sorted(CONSOLE_SCRIPT_HELP)


@pytest.mark.parametrize("script", sorted(CONSOLE_SCRIPT_HELP))
def test_every_console_script_prints_its_help_and_exits_0(script):
    """The installed script, not `python -m`: under pip's wrapper `__main__` defines no flags, and
    absl's own --help printed a bare "USAGE ... Try --helpfull" and exited 1 (ppo-jax-sweep did)."""
    path = os.path.join(os.path.dirname(sys.executable), script)
    assert os.path.isfile(path), f"{script} is not installed beside {sys.executable}: pip install -e ."
    out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    missing = [text for text in CONSOLE_SCRIPT_HELP[script] if text not in out.stdout]
    assert not missing, (missing, out.stdout[:2000])
    assert "Try --helpfull" not in out.stdout


@pytest.mark.parametrize("command,args,expect", [
    ("ppo_jax.cli.plan", [f"--config={REPO}/configs/plan_tiny.py", "--help"], "--device_memory_gb"),
    ("ppo_jax.cli.sweep", ["--help"], "--trainer:"),
    ("ppo_jax.demo.kl_sweep", ["--help"], "--kl_coefs"),
    ("ppo_jax.cli.dpo", [f"--config={REPO}/configs/dpo.py", "--help"], "--config.loss.label_smoothing=0.0"),
])
def test_help_exits_0_under_python_m(command, args, expect):
    out = subprocess.run([sys.executable, "-m", command, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert expect in out.stdout


def test_cli_missing_config_file_is_one_line_exit_2(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.train", f"--config={tmp_path}/nope.py",
                          f"--workdir={tmp_path}/run"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("error: config file ") and not (tmp_path / "run").exists()


def test_no_transformers_advice_on_a_core_install():
    """Without torch, `import transformers` prints "PyTorch was not found ..." — and the demo's
    settings import it at module load, before any CLI code runs. Hiding torch from transformers'
    availability check reproduces a core install."""
    code = ("import importlib.util\n"
            "find = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name == 'torch' else find(name, *a)\n"
            "import ppo_jax.demo.pipeline\n"
            "import transformers.utils.import_utils as iu\n"
            "assert not iu.is_torch_available()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "PyTorch was not found" not in out.stderr and "[transformers]" not in out.stderr, out.stderr
