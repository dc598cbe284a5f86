"""ppo-jax-sweep (ppo_jax/sweep, ppo_jax/cli/sweep.py): grid expansion, one-line refusals before any
run, resume of an interrupted sweep, the mean ± t-interval table against scipy's own interval, and a
tiny sweep of the verifiable-reward task (SFT then RL) end to end."""

import csv
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.stats

from ppo_jax.config import ConfigError
from ppo_jax.config_file import load_config
from ppo_jax.sweep import devices, plots, results, runner, spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "configs", "ppo_toy.py")


def test_a_grid_is_every_combination_times_the_seeds():
    axes = [spec.parse_axis("ppo.kl_coef=0.01,0.1"), spec.parse_axis("--config.mesh.shape=(1,2,1),(2,1,1),(1,1,2)")]
    assert axes[1] == spec.Axis("mesh.shape", ("(1,2,1)", "(2,1,1)", "(1,1,2)"))
    runs = spec.expand(axes, spec.parse_seeds("2"))
    assert len(runs) == 2 * 3 * 2 and len({r.name for r in runs}) == len(runs)
    assert [r.seed for r in runs[:4]] == [0, 1, 0, 1]  # point-major: a point's seeds together
    assert runs[3].overrides() == ["--config.ppo.kl_coef=0.01", "--config.mesh.shape=(2,1,1)", "--config.seed=1"]
    assert runs[3].label == "ppo.kl_coef=0.01, mesh.shape=(2,1,1)"
    zipped = spec.expand([spec.parse_axis("a=1,2"), spec.parse_axis("b=x,y")], (7,), zipped=True)
    assert [r.point for r in zipped] == [(("a", "1"), ("b", "x")), (("a", "2"), ("b", "y"))]
    assert [r.seed for r in spec.expand([], spec.parse_seeds("0,4,7"))] == [0, 4, 7]


@pytest.mark.parametrize("grid, seeds, message", [
    (["ppo.kl_coef="], "3", "ppo.kl_coef has no values"),
    (["ppo.kl_coef"], "3", "write FIELD=VALUE,VALUE"),
    (["ppo.kl_coef=0.1,0.1"], "3", "--grid ppo.kl_coef: repeats a value"),
    (["ppo.kl_coef=0.1", "ppo.kl_coef=0.2"], "3", "a field is swept twice: ppo.kl_coef"),
    (["seed=1,2"], "3", "seed is swept by --seeds"),
    ([], "0", "a count must be at least 1"),
    ([], "1,1", "give distinct seeds"),
    ([], "two", "give a count"),
])
def test_bad_specs_are_refused(grid, seeds, message):
    with pytest.raises(ConfigError, match=message):
        spec.expand([spec.parse_axis(g) for g in grid], spec.parse_seeds(seeds))


def test_a_list_pairs_values_and_may_repeat_them():
    """--zip: three estimators beside their sample counts (1, 4, 4), the same sample budget each."""
    runs = spec.expand([spec.parse_axis("ppo.advantage_estimator=gae,grpo,rloo"),
                        spec.parse_axis("rollout.num_samples=1,4,4")], (0,), zipped=True)
    assert [r.label for r in runs] == ["ppo.advantage_estimator=gae, rollout.num_samples=1",
                                       "ppo.advantage_estimator=grpo, rollout.num_samples=4",
                                       "ppo.advantage_estimator=rloo, rollout.num_samples=4"]
    with pytest.raises(ConfigError, match="every field needs as many values; a has 2, b has 1"):
        spec.expand([spec.parse_axis("a=1,2"), spec.parse_axis("b=x")], (0,), zipped=True)
    with pytest.raises(ConfigError, match="--zip: two points are the same"):
        spec.expand([spec.parse_axis("a=1,1"), spec.parse_axis("b=x,x")], (0,), zipped=True)


def test_unknown_fields_and_wrong_types_are_one_line_errors_before_any_run(tmp_path):
    config = load_config(TOY)
    runs = spec.expand([spec.parse_axis("ppo.kl_coef=0.1,abc")], (0,))
    with pytest.raises(ConfigError, match=r"--config.ppo.kl_coef=abc: ppo.kl_coef takes a number"):
        spec.check_runs(runs, config, [])
    with pytest.raises(ConfigError, match="did you mean --config.rollout.batch_size"):
        spec.check_runs(spec.expand([], (0,)), config, ["--config.rollout.batch_sise=8"])
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.sweep", "--trainer=ppo", f"--config={TOY}",
                          f"--sweep_dir={tmp_path}/sweep", "--grid=ppo.kl_cof=0.1,0.2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("error: unknown config field --config.ppo.kl_cof"), out.stderr
    assert out.stderr.count("\n") == 1 and not (tmp_path / "sweep").exists()


FAKE_TRAINER = r"""
import json, os, sys
workdir, seed, value = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
os.makedirs(workdir, exist_ok=True)
with open(os.path.join(os.path.dirname(os.path.dirname(workdir)), "calls.txt"), "a") as f:
    f.write(os.path.basename(workdir) + "\n")
flaky = os.path.join(os.path.dirname(os.path.dirname(workdir)), "fail_once")
if value == 2.0 and seed == 1 and os.path.exists(flaky):
    os.remove(flaky)
    print("error: the flaky run failed"); sys.exit(1)
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for step in range(1, 4):
        f.write(json.dumps({"step": step, "score": value * step + seed}) + "\n")
with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({"final": {"gap": value + 0.1 * seed}}, f)
print("done: fake")
"""


def _fake_command(run, workdir):
    point = dict(run.point)
    return [sys.executable, "-c", FAKE_TRAINER, workdir, str(run.seed), point["x"]]


def test_an_interrupted_sweep_reruns_only_what_did_not_finish(tmp_path):
    sweep_dir = str(tmp_path)
    runs = spec.expand([spec.parse_axis("x=1.0,2.0")], (0, 1))
    (tmp_path / "fail_once").touch()
    reported = []
    outcomes = runner.run_sweep(runs, sweep_dir, _fake_command, parallel=2,
                                report=lambda o, done, total: reported.append((o.run.name, o.ok, done, total)))
    assert [o.ok for o in outcomes] == [True, True, True, False]
    assert outcomes[3].last_line == "error: the flaky run failed" and outcomes[3].returncode == 1
    assert sorted(reported)[-1][2:] == (4, 4) and len(reported) == 4
    reported.clear()
    again = runner.run_sweep(runs, sweep_dir, _fake_command, parallel=2,
                             report=lambda o, done, total: reported.append((o.run.name, o.ran_now, done)))
    assert reported == [(r.name, False, i + 1) for i, r in enumerate(runs[:3])] + [(runs[3].name, True, 4)]
    assert all(o.ok for o in again) and [o.ran_now for o in again] == [False, False, False, True]
    calls = (tmp_path / "calls.txt").read_text().split()
    assert sorted(calls) == sorted([r.name for r in runs] + [runs[3].name])  # the finished ones ran once
    # The failed attempt's log is kept beside the one that finished; the record names the latest.
    logs = tmp_path / "logs"
    assert (logs / f"{runs[3].name}.attempt-1.log").read_text().strip() == "error: the flaky run failed"
    assert (logs / f"{runs[3].name}.attempt-2.log").read_text().strip() == "done: fake"
    assert not (logs / f"{runs[0].name}.attempt-2.log").exists()
    record = json.loads((logs / f"{runs[3].name}.json").read_text())
    assert record["attempt"] == 2 and record["log"] == f"{runs[3].name}.attempt-2.log" and record["returncode"] == 0
    manifest = {"trainer": "fake", "runs": [r.name for r in runs]}
    runner.write_manifest(sweep_dir, manifest)
    runner.write_manifest(sweep_dir, manifest)  # the same sweep again: accepted
    with pytest.raises(ConfigError, match="holds another sweep \\(runs differ"):
        runner.write_manifest(sweep_dir, {**manifest, "runs": manifest["runs"][:2]})


def test_a_sweep_resumed_after_its_config_file_changed_is_refused(tmp_path):
    config = tmp_path / "config.py"
    config.write_text("def get_config():\n    return None\n")
    manifest = {"trainer": "fake", "config": str(config), "config_sha256": runner.config_sha256(str(config)),
                "runs": ["a"]}
    runner.write_manifest(str(tmp_path / "sweep"), manifest)
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["config_sha256"] == manifest["config_sha256"]
    assert runner.config_sha256(f"{config}:arg") == manifest["config_sha256"]  # `path.py:arg` hashes the file
    config.write_text("def get_config():\n    return 1\n")
    edited = dict(manifest, config_sha256=runner.config_sha256(str(config)))
    with pytest.raises(ConfigError, match=r"the config file .*config.py changed since this sweep started"):
        runner.write_manifest(str(tmp_path / "sweep"), edited)
    older = tmp_path / "older"  # a sweep recorded before configs were hashed resumes as before
    runner.write_manifest(str(older), {k: v for k, v in manifest.items() if k != "config_sha256"})
    runner.write_manifest(str(older), edited)


def test_the_command_refuses_an_edited_config_in_one_line_and_writes_nothing(tmp_path):
    """Each run fails at once (a missing policy path); the second command, after the config file was
    edited, is refused before it runs or writes anything."""
    config = tmp_path / "ppo.py"
    config.write_text(open(TOY).read())
    argv = [sys.executable, "-m", "ppo_jax.cli.sweep", "--trainer=ppo", f"--config={config}", "--seeds=1",
            f"--sweep_dir={tmp_path}/sweep", f"--config.policy.path={tmp_path}/nowhere"]
    first = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert first.returncode == 1 and "FAILED (exit 2)" in first.stdout, first.stdout[-2000:] + first.stderr[-2000:]
    config.write_text(open(TOY).read() + "# edited\n")
    before = sorted(p.name for p in (tmp_path / "sweep").rglob("*"))
    second = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert second.stderr.startswith(f"error: the config file {config} changed since this sweep started")
    assert sorted(p.name for p in (tmp_path / "sweep").rglob("*")) == before


SLOT_CHILD = r"""
import os, sys, time
lock = os.path.join(sys.argv[1], "slot-" + os.environ["SLOT"])
os.close(os.open(lock, os.O_CREAT | os.O_EXCL))  # fails if another run holds this slot now
time.sleep(0.3)
os.remove(lock)
print("done: slot " + os.environ["SLOT"])
"""


def test_each_run_gets_the_environment_of_a_slot_no_other_run_holds(tmp_path):
    runs = spec.expand([spec.parse_axis("x=1,2,3")], (0, 1))
    envs = [dict(os.environ, SLOT=name) for name in ("a", "b")]
    outcomes = runner.run_sweep(runs, str(tmp_path), lambda run, workdir: [sys.executable, "-c", SLOT_CHILD, str(tmp_path)],
                                parallel=2, slot_envs=envs)
    assert all(o.ok for o in outcomes), [o.last_line for o in outcomes]
    assert {o.last_line for o in outcomes} == {"done: slot a", "done: slot b"}
    with pytest.raises(ValueError, match="1 slot environments for parallel=2"):
        runner.run_sweep(runs, str(tmp_path), _fake_command, parallel=2, slot_envs=envs[:1])


GPUS = devices.Accelerators("gpu", gpu_ids=tuple(str(i) for i in range(8)))


@pytest.mark.parametrize("accelerators, parallel, visible, fraction", [
    (devices.Accelerators("cpu"), 3, [None] * 3, None),
    (GPUS, 1, [None], None),  # one run at a time: the sweep's own environment
    (GPUS, 2, ["0,1,2,3", "4,5,6,7"], None),
    (GPUS, 3, ["0,1", "2,3", "4,5"], None),  # 6 and 7 idle: every run gets as many
    (devices.Accelerators("gpu", gpu_ids=("0",)), 2, ["0", "0"], "0.375"),  # 0.75 of one process, halved
    (devices.Accelerators("gpu", gpu_ids=("3", "GPU-5")), 4, ["3", "GPU-5", "3", "GPU-5"], "0.375"),
])
def test_parallel_runs_on_gpus_get_their_own_gpus_or_a_share_of_the_memory(accelerators, parallel, visible, fraction):
    envs, note = devices.slot_environments(parallel, accelerators, {"PATH": "/bin"})
    assert len(envs) == parallel and all(env["PATH"] == "/bin" for env in envs)
    assert [env.get("CUDA_VISIBLE_DEVICES") for env in envs] == visible
    assert {env.get("XLA_PYTHON_CLIENT_MEM_FRACTION") for env in envs} == {fraction}
    assert bool(note) == (accelerators.platform == "gpu" and parallel > 1)


def test_a_users_memory_fraction_is_divided_and_a_tpu_host_runs_one_at_a_time():
    envs, note = devices.slot_environments(3, devices.Accelerators("gpu", gpu_ids=("0",)),
                                           {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    assert [env["XLA_PYTHON_CLIENT_MEM_FRACTION"] for env in envs] == ["0.300"] * 3 and "3 runs on each" in note
    tpu = devices.Accelerators("tpu", tpu_chips=4)
    assert devices.slot_environments(1, tpu, {})[0] == [{}]
    with pytest.raises(ConfigError, match=r"--parallel=2 on a TPU host: its 4 chips open in one process at a time; "
                                          r"use --parallel=1"):
        devices.slot_environments(2, tpu, {})


def test_the_accelerators_a_child_would_open_are_found_without_starting_jax(tmp_path, monkeypatch):
    for name in ("nvidia0", "nvidia1", "nvidia10", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    monkeypatch.setattr(devices, "_tpu_chips", lambda: 0)
    assert devices.local_accelerators({}, dev=str(tmp_path)) == devices.Accelerators("gpu", gpu_ids=("0", "1", "10"))
    assert devices.local_accelerators({"CUDA_VISIBLE_DEVICES": "1,0"}, dev=str(tmp_path)).gpu_ids == ("1", "0")
    assert devices.local_accelerators({"CUDA_VISIBLE_DEVICES": ""}, dev=str(tmp_path)).platform == "cpu"
    assert devices.local_accelerators({"JAX_PLATFORMS": "cpu"}, dev=str(tmp_path)).platform == "cpu"
    assert devices.local_accelerators({}, dev=str(tmp_path / "none")).platform == "cpu"
    monkeypatch.setattr(devices, "_tpu_chips", lambda: 4)
    assert devices.local_accelerators({}, dev=str(tmp_path)) == devices.Accelerators("tpu", tpu_chips=4)
    assert devices.local_accelerators({"JAX_PLATFORMS": "cpu"}, dev=str(tmp_path)).platform == "cpu"


def test_the_table_pools_seeds_into_a_t_interval(tmp_path):
    sweep_dir = str(tmp_path)
    runs = spec.expand([spec.parse_axis("x=1.0,2.0")], (0, 1, 2))
    (tmp_path / "fail_once").touch()  # x=2.0, seed 1 fails: that point has two seeds
    outcomes = runner.run_sweep(runs, sweep_dir, _fake_command, parallel=2)
    metrics = ("final.gap", "score")
    read = [results.read_run(sweep_dir, o, metrics, "metrics.jsonl", curves=("score",)) for o in outcomes]
    rows = results.aggregate(read, metrics)
    for row, value, seeds in ((rows[0], 1.0, (0, 1, 2)), (rows[1], 2.0, (0, 2))):
        for metric, finals in (("final.gap", [value + 0.1 * s for s in seeds]), ("score", [3 * value + s for s in seeds])):
            mean = np.mean(finals)
            low, high = scipy.stats.t.interval(0.95, len(finals) - 1, loc=mean, scale=scipy.stats.sem(finals))
            got = row.stats[metric]
            assert got.n == len(finals) and math.isclose(got.mean, mean, rel_tol=1e-12)
            assert math.isclose(got.half_width, (high - low) / 2, rel_tol=1e-9)
    assert rows[1].finished == 2 and rows[1].failures[0].endswith("error: the flaky run failed")
    csv_path, md_path = results.write_tables(rows, metrics, ["x"], sweep_dir)
    with open(csv_path) as f:
        table = list(csv.DictReader(f))
    assert table[1]["x"] == "2.0" and table[1]["finished"] == "2" and float(table[1]["score_n"]) == 2
    text = open(md_path).read()
    assert "| 1.0 | 3/3 | 1.1 ± 0.25 | 4 ± 2.5 |" in text and "Failed runs" in text
    assert results.stat([0.5]).text() == "0.5" and math.isnan(results.stat([]).mean)
    steps, mean, half = plots.mean_curve([r.curves["score"] for r in read[:3]])  # x = 1.0: score = step + seed
    assert steps.tolist() == [1, 2, 3] and np.allclose(mean, [2.0, 3.0, 4.0])
    assert np.allclose(half, scipy.stats.t.ppf(0.975, 2) * 1.0 / math.sqrt(3))


def test_a_tiny_sweep_of_the_verifiable_task_end_to_end(tmp_path):
    """Two estimators on the verifiable-reward task (SFT, then RL on the exact-match reward), two
    processes at a time: each run's summary, the table, the curves and a summary plot."""
    tiny = ["--config.corpus.num_train=256", "--config.corpus.num_eval=32", "--config.sft.train.steps=10",
            "--config.sft.model.config.num_layers=1", "--config.rl.train.iterations=2", "--config.eval.every=1",
            "--config.eval.num_prompts=16", "--config.rl.train.sample_every=0", "--config.progress=false"]
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.sweep", "--trainer=verifiable", f"--sweep_dir={tmp_path}",
                          "--grid=rl.ppo.advantage_estimator=grpo,rloo", "--seeds=1", "--parallel=2", *tiny],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count(": finished in ") == 2 and "exact-match accuracy on 64 held-out samples" in out.stdout
    with open(tmp_path / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [row["rl.ppo.advantage_estimator"] for row in table] == ["grpo", "rloo"]
    for row in table:
        assert 0.0 <= float(row["accuracy_after_mean"]) <= 1.0 and float(row["accuracy_after_n"]) == 1
    summary = json.loads((tmp_path / "runs" / "001_advantage_estimator=rloo_seed=0" / "summary.json").read_text())
    assert summary["estimator"] == "rloo" and summary["samples_per_prompt"] == 4
    log = results.read_log(str(tmp_path / "runs" / "001_advantage_estimator=rloo_seed=0" / "rl" / "metrics.jsonl"))
    assert [row["step"] for row in log if "eval/accuracy" in row] == [0, 1, 2]
    assert (tmp_path / "plots" / "curves.png").stat().st_size > 0
    assert (tmp_path / "plots" / "summary_rl.ppo.advantage_estimator.png").stat().st_size > 0
    manifest = json.loads((tmp_path / "sweep.json").read_text())
    assert manifest["trainer"] == "verifiable" and len(manifest["runs"]) == 2


@pytest.mark.parametrize("panels", [1, 3])
def test_the_curves_legend_fits_in_the_figure_with_long_labels(panels):
    """Six points of ten fields each (issue 61's objectives sweep): every legend entry lies inside the
    figure, below the panels (its labels were cut off at both sides)."""
    fields = [f"rl.ppo.field_{i}" for i in range(10)]
    steps = np.arange(5)
    outcomes = [runner.Outcome(spec.Run(i, tuple((f, f"value{i}") for f in fields), 0), 0, 1.0, "done")
                for i in range(6)]
    metrics = [f"m{j}" for j in range(panels)]
    fig = plots.plot_curves([results.RunResult(o, {}, {m: (steps, steps * 1.0) for m in metrics}) for o in outcomes],
                            metrics)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    figure_box = fig.get_window_extent(renderer)
    legend_box = fig.legends[0].get_window_extent(renderer)
    panels_bottom = min(ax.get_window_extent(renderer).y0 for ax in fig.axes)
    if panels == 3:  # labels this long fit the 3-panel figure's width
        assert figure_box.x0 <= legend_box.x0 and legend_box.x1 <= figure_box.x1
    assert legend_box.y0 >= figure_box.y0 and legend_box.y1 <= panels_bottom
    assert len(fig.legends[0].get_texts()) == 6
