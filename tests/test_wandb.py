"""Weights & Biases logging (`WandbSettings`, `ppo_jax.wandb_run`): a real offline run of the tiny PPO config
holds metrics.jsonl's names and steps, the config and the samples, and its resume continues the same W&B run;
a fake `wandb` module checks the writer, the demo's summary run and the sweep's grouping without a
trainer; a missing package is one line before anything is written. Nothing touches the network."""

import glob
import json
import os
import struct
import sys
import types

import numpy as np
import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax import metrics as metrics_lib
from ppo_jax.cli.sweep import run_environment
from ppo_jax.config import ConfigError, WandbSettings
from ppo_jax.demo import pipeline
from ppo_jax.demo.settings import DemoSettings, get_config
from ppo_jax.rl.settings import Settings
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.wandb_run import RUN_ID_FILE, metric_writer


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """W&B offline, silent, every file of it under tmp_path."""
    pytest.importorskip("wandb", reason='the [test] extra installs it: pip install -e ".[test]"')
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_CONSOLE", "off"),
                        ("WANDB_CACHE_DIR", tmp_path / "cache"), ("WANDB_CONFIG_DIR", tmp_path / "config"),
                        ("WANDB_DATA_DIR", tmp_path / "data"), ("WANDB_ARTIFACT_DIR", tmp_path / "artifacts")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.delenv("WANDB_DIR", raising=False)  # the default: the run's files under its workdir
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def read_records(path):
    """The records of a .wandb file (W&B's LevelDB-style log: a 7-byte header, then 32 KiB blocks of
    [crc u32, length u16, type u8] chunks: 1 full, 2 first, 3 middle, 4 last), as protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, payload, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            records.append(record)
            payload = b""
    return records


def offline_run(run_dir):
    """(run record, {step: {key: value}}, config {key: value}) of one offline-run-* directory."""
    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    run, history, config = None, {}, {}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({u.key: json.loads(u.value_json) for u in run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
        elif kind == "history":
            row = history.setdefault(int(record.history.step.num), {})
            for item in record.history.item:  # nested_key: ["samples", "_type"] for a table's fields
                *parents, key = list(item.nested_key) or [item.key]
                target = row
                for parent in parents:
                    target = target.setdefault(parent, {})
                target[key] = json.loads(item.value_json)
    return run, history, config


def small(**overrides):
    """The tiny PPO config, offline W&B, samples every iteration; one update step per iteration (cheap)."""
    return tiny_config(**{"wandb.mode": "offline", "train.sample_every": 1, "rollout.batch_size": 8,
                          "rollout.forward_microbatch": 0, "ppo.epochs": 1, "ppo.num_minibatches": 1,
                          "ppo.num_microbatches": 1, **overrides})


def test_offline_ppo_run_holds_metrics_config_and_samples_and_resume_continues_it(offline, tmp_path):
    workdir = tmp_path / "run"
    first = PPOTrainer(small(**{"wandb.tags": ("tiny",), "train.iterations": 1}), str(workdir),
                       mesh=make_test_mesh((1, 1, 1)))
    first.train()
    first.close()
    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    (run_dir,) = glob.glob(str(workdir / "wandb" / "offline-run-*"))
    run, history, logged_config = offline_run(run_dir)
    assert run.run_id == run_id and run.display_name == "run" and run.job_type == "ppo" and list(run.tags) == ["tiny"]
    rows = metrics_lib.read_metrics(str(workdir / "metrics.jsonl"))
    assert sorted(history) == [r["step"] for r in rows] == [1]
    for row in rows:  # every metrics.jsonl name and value, at its step (NaN = NaN)
        names = set(row) - {"step", "time"}
        assert names <= set(history[row["step"]]), names - set(history[row["step"]])
        np.testing.assert_array_equal([history[row["step"]][k] for k in sorted(names)], [row[k] for k in sorted(names)])
    assert logged_config["ppo"]["kl_coef"] == Settings().ppo.kl_coef
    assert logged_config["wandb"]["mode"] == "offline" and logged_config["rollout"]["batch_size"] == 8
    # The samples: a table per sample step, the rows of samples.jsonl.
    assert history[1]["samples"]["_type"] == "table-file"
    samples = [json.loads(line) for line in open(workdir / "samples.jsonl")]
    (table_path,) = glob.glob(os.path.join(run_dir, "files", "media", "table", "samples_1_*.table.json"))
    table = json.load(open(table_path))
    assert table["columns"] == ["prompt", "response", "score", "kl"]
    assert [r[:2] for r in table["data"]] == [[s["prompt"], s["response"]] for s in samples if s["step"] == 1]

    resumed = PPOTrainer(small(**{"train.iterations": 2}), str(workdir), mesh=make_test_mesh((1, 1, 1)))
    assert resumed.resumed_from == 1
    resumed.train()
    resumed.close()
    (second,) = set(glob.glob(str(workdir / "wandb" / "offline-run-*"))) - {run_dir}
    run, history, _ = offline_run(second)
    assert run.run_id == run_id and (workdir / RUN_ID_FILE).read_text().strip() == run_id  # the same W&B run
    assert sorted(history) == [2]  # it goes on from the checkpoint (`wandb sync` appends to the run)
    assert history[2]["objective/scores"] == metrics_lib.read_metrics(str(workdir / "metrics.jsonl"))[-1]["objective/scores"]


def test_a_missing_package_is_one_line_before_anything_is_written(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    Settings.from_config(tiny_config())  # off by default: never imported
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        PPOTrainer(tiny_config(**{"wandb.mode": "online"}), str(workdir))
    assert str(err.value) == ("wandb.mode='online' needs the wandb package, which is not installed: "
                              'pip install "ppo_jax[wandb]" (or wandb.mode=disabled)')
    assert not workdir.exists()
    with pytest.raises(ConfigError, match=r"wandb.mode='offlne': use one of disabled, online, offline"):
        Settings.from_config(tiny_config(**{"wandb.mode": "offlne"}))


class FakeWandb(types.ModuleType):
    """A `wandb` module that records what it is given."""

    def __init__(self):
        super().__init__("wandb")
        self.runs = []
        fake = self

        class Run:
            def __init__(self, **kwargs):
                self.init, self.logged, self.summary, self.finished, self.step = kwargs, [], {}, False, 0
                fake.runs.append(self)

            def log(self, row, step=None):
                self.logged.append((step, row))

            def finish(self):
                self.finished = True

        self.init = lambda **kwargs: Run(**kwargs)
        self.Table = lambda columns, data: ("Table", columns, data)
        self.Image = lambda path: ("Image", path)


def test_the_writer_mirrors_rows_samples_and_resumes_the_same_run(monkeypatch, tmp_path):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    settings = WandbSettings(mode="offline", project="p", group="g")
    writer = metric_writer(str(tmp_path), tensorboard=False, wandb=settings, run_config={"seed": 3},
                           job_type="sft")
    writer.write(1, {"train/loss": 2.0})
    writer.write_samples(1, [{"prompt": "a", "score": 1.0}, {"prompt": "b", "kl": 0.5}])
    writer.close()
    writer.write(2, {"train/loss": 1.0})  # after close: the files only
    (run,) = fake.runs
    init = run.init
    assert (init["mode"], init["project"], init["group"], init["job_type"], init["config"], init["resume"]) == (
        "offline", "p", "g", "sft", {"seed": 3}, "allow")
    assert init["name"] == tmp_path.name and init["dir"] == str(tmp_path) and init["entity"] is None
    assert init["id"] == (tmp_path / RUN_ID_FILE).read_text().strip()
    assert run.logged == [(1, {"train/loss": 2.0}),
                          (1, {"samples": ("Table", ["prompt", "score", "kl"], [["a", 1.0, None], ["b", None, 0.5]])})]
    assert run.finished
    again = metric_writer(str(tmp_path), tensorboard=False, wandb=settings, resume_step=1)
    assert fake.runs[1].init["id"] == init["id"]  # the workdir's run, continued
    again.close()
    metric_writer(str(tmp_path / "off"), tensorboard=False, wandb=WandbSettings()).close()
    assert len(fake.runs) == 2  # mode "disabled": no run


def test_demo_stages_share_a_group_and_the_summary_run_holds_the_plots(monkeypatch, tmp_path):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    config = get_config()
    config.wandb.mode = "offline"
    settings = DemoSettings.from_config(config)
    workdir = tmp_path / "demo7"
    stage = settings.stage_wandb("ppo", str(workdir))
    assert (stage.name, stage.group, stage.mode) == ("demo7-ppo", "demo7", "offline")
    monkeypatch.setenv("WANDB_RUN_GROUP", "kl_sweep")  # inside a sweep: the sweep's group
    assert settings.stage_wandb("sft", str(workdir)).group == "kl_sweep"
    os.makedirs(workdir / "plots")
    for name in ("ppo_curves.png", "sft_reward_model.png"):
        (workdir / "plots" / name).write_bytes(b"png")
    ppo = types.SimpleNamespace(before=[{"prompt": "p", "response": "r0", "gold": 0.1}],
                                after=[{"prompt": "p", "response": "r1", "gold": 0.9}])
    pipeline._wandb_summary(settings, str(workdir), {"gap_closed": 0.5}, ppo)
    (run,) = fake.runs
    assert run.init["job_type"] == "summary" and run.summary == {"gap_closed": 0.5} and run.finished
    images = run.logged[-1][1]
    assert images == {"plots/ppo_curves": ("Image", str(workdir / "plots" / "ppo_curves.png")),
                      "plots/sft_reward_model": ("Image", str(workdir / "plots" / "sft_reward_model.png"))}
    config.ppo.wandb.mode = "offline"
    with pytest.raises(ConfigError, match="demo: ppo.wandb is set"):
        DemoSettings.from_config(config)


def test_a_sweeps_runs_are_grouped_by_its_name():
    assert run_environment("/x/runs/kl")["WANDB_RUN_GROUP"] == "kl"
    assert run_environment("/x/runs/kl", {"WANDB_RUN_GROUP": "mine"})["WANDB_RUN_GROUP"] == "mine"
