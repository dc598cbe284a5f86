"""bench/bench_peer.py's pure parts (no training): the field table covers every setting the runs use,
the results JSON's schema, the mean ± 95% interval and the paired difference against SciPy, and the
resume logic (a seed already in the JSON is not run again)."""

import dataclasses
import json
import math
import os
import sys

import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import bench_peer as bp  # noqa: E402


@pytest.fixture(scope="module", params=[False, True], ids=["full", "quick"])
def demo(request):
    return bp.demo_settings(0, quick=request.param)


@pytest.mark.parametrize("method", bp.METHODS)
def test_every_setting_the_runs_use_is_paired_or_named_as_a_difference(demo, method):
    s = bp.ppo_jax_settings(method, demo)
    changed = bp.changed_fields(method, s)
    assert changed, "the demo sets fields of its own"
    missing = [name for name in changed if name not in bp.covered(method)]
    assert not missing, f"{method}: demo settings in no table: {missing}"
    for pair in bp.PAIRS[method]:
        bp.field(s, pair.ours)  # names a real field

    kwargs = bp.trl_kwargs(method, s)
    theirs = {p.theirs for p in bp.PAIRS[method] if not p.argument}
    unexplained = set(kwargs) - theirs - set(bp.TRL_FIXED[method]) - bp.TRL_HARNESS
    assert not unexplained, f"{method}: TRL fields set outside the table: {unexplained}"
    for pair in bp.PAIRS[method]:
        if not pair.argument:
            assert kwargs[pair.theirs] == pair.convert(bp.field(s, pair.ours), s), (method, pair)


def test_the_pairs_carry_the_demo_values_across():
    demo = bp.demo_settings(0, quick=False)
    ppo = bp.trl_kwargs("ppo", bp.ppo_jax_settings("ppo", demo))
    assert (ppo["per_device_train_batch_size"], ppo["num_mini_batches"], ppo["num_ppo_epochs"]) == (64, 2, 4)
    assert ppo["total_episodes"] == 64 * 60 and ppo["response_length"] == 16 and ppo["kl_coef"] == 0.1
    assert ppo["learning_rate"] == 3e-4 and ppo["warmup_steps"] == 5 and ppo["stop_token"] == "eos"
    grpo_s = bp.ppo_jax_settings("grpo", demo)
    assert (grpo_s.rollout.batch_size, grpo_s.rollout.num_samples) == (16, 4)  # the methods table's GRPO
    grpo = bp.trl_kwargs("grpo", grpo_s)
    rows = grpo["per_device_train_batch_size"] * grpo["steps_per_generation"]
    assert rows == 64 and grpo["num_generations"] == 4 and grpo["num_iterations"] == 4
    assert grpo["max_steps"] == 60 * 4 * 2 and grpo["beta"] == 0.0 and grpo["loss_type"] == "bnpo"
    dpo = bp.trl_kwargs("dpo", bp.ppo_jax_settings("dpo", demo))
    assert (dpo["beta"], dpo["max_steps"], dpo["per_device_train_batch_size"], dpo["max_length"]) == (0.3, 300, 64, 26)


def test_the_trl_fields_exist_in_the_pinned_trl():
    trl = pytest.importorskip("trl")
    if trl.__version__ != "0.29.1":
        pytest.skip(f"trl {trl.__version__} installed; the [bench] extra pins 0.29.1")
    from trl import DPOConfig, GRPOConfig
    from trl.experimental.ppo import PPOConfig

    demo = bp.demo_settings(0, quick=False)
    for method, config in (("ppo", PPOConfig), ("grpo", GRPOConfig), ("dpo", DPOConfig)):
        names = {f.name for f in dataclasses.fields(config)}
        unknown = set(bp.trl_kwargs(method, bp.ppo_jax_settings(method, demo))) - names
        assert not unknown, (method, unknown)


def test_the_fields_table_names_every_pair_and_difference():
    text = bp.fields_markdown()
    for method in bp.METHODS:
        for pair in bp.PAIRS[method]:
            assert f"`{pair.ours}`" in text and f"`{pair.theirs}`" in text
        for d in bp.DIFFERENCES[method]:
            assert d.trl in text


def entry(seed, gap, kl, max_kl, seconds):
    return {"seed": seed, "gap_closed": gap, "kl": kl, "max_kl": max_kl, "seconds": seconds}


def fake_results(seeds=(0, 1, 2, 3, 4), rng=np.random.default_rng(0)):
    results = bp.new_results(quick=False)
    for lib in bp.LIBRARIES:
        for method in bp.METHODS:
            for seed in seeds:
                bp.add_entry(results, lib, method, entry(seed, float(rng.uniform(0.5, 0.8)), float(rng.uniform(1, 3)),
                                                         None if method == "dpo" else float(rng.uniform(2, 4)),
                                                         float(rng.uniform(100, 400))))
    return results


def test_the_json_schema_round_trips_and_refuses_what_does_not_fit(tmp_path):
    results = fake_results()
    path = str(tmp_path / "peer.json")
    bp.save_results(results, path)
    loaded = bp.load_results(path, quick=False)
    assert loaded == json.loads(json.dumps(results))
    assert set(loaded["ppo_jax"]) == set(loaded["trl"]) == {"ppo", "grpo", "dpo"}
    assert all(set(bp.ENTRY_KEYS) <= set(e) for lib in bp.LIBRARIES for m in bp.METHODS for e in loaded[lib][m])
    with pytest.raises(SystemExit, match="quick"):
        bp.load_results(path, quick=True)
    for broken in (
        lambda r: r["trl"]["ppo"][0].pop("kl"),
        lambda r: r["trl"]["ppo"][0].update(max_kl=None),  # only DPO has no training KL
        lambda r: r["ppo_jax"]["dpo"][0].update(max_kl=1.0),
        lambda r: r["ppo_jax"]["grpo"].append(dict(r["ppo_jax"]["grpo"][0])),  # a seed twice
        lambda r: r["trl"].pop("dpo"),
        lambda r: r["trl"]["ppo"][1].update(gap_closed="72%"),
    ):
        bad = json.loads(json.dumps(results))
        broken(bad)
        with pytest.raises(ValueError):
            bp.check_schema(bad)
    with pytest.raises(ValueError, match="already"):
        bp.add_entry(results, "trl", "ppo", entry(0, 0.5, 1.0, 2.0, 10.0))


def scipy_interval(values):
    x = np.asarray(values, np.float64)
    low, high = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x))
    return x.mean(), (high - low) / 2


def test_interval_and_paired_difference_match_scipy():
    results = fake_results()
    del results["trl"]["grpo"][2]  # seed 2 missing on one side: the pairing uses the common seeds
    for method in bp.METHODS:
        for key in ("gap_closed", "kl", "seconds") + (() if method == "dpo" else ("max_kl",)):
            for lib in bp.LIBRARIES:
                values = [e[key] for e in results[lib][method]]
                st = bp.interval(values)
                mean, half = scipy_interval(values)
                assert st.n == len(values) and math.isclose(st.mean, mean) and math.isclose(st.half_width, half)
            st, seeds = bp.paired(results, method, key)
            ours = {e["seed"]: e[key] for e in results["ppo_jax"][method]}
            theirs = {e["seed"]: e[key] for e in results["trl"][method]}
            assert seeds == sorted(set(ours) & set(theirs)) == ([0, 1, 3, 4] if method == "grpo" else [0, 1, 2, 3, 4])
            diffs = [ours[s] - theirs[s] for s in seeds]
            mean, half = scipy_interval(diffs)
            assert math.isclose(st.mean, mean) and math.isclose(st.half_width, half)
            # the paired interval is the one-sample t-test's on the differences
            test = stats.ttest_rel([ours[s] for s in seeds], [theirs[s] for s in seeds])
            assert math.isclose(mean / (half / stats.t.ppf(0.975, len(seeds) - 1)), test.statistic)

    table = bp.table_markdown(results)
    st, _ = bp.paired(results, "ppo", "gap_closed")
    assert f"{st.mean * 100:.1f} points ± {st.half_width * 100:.1f}" in table
    st = bp.interval([e["gap_closed"] for e in results["trl"]["dpo"]])
    assert f"{st.mean * 100:.1f}% ± {st.half_width * 100:.1f}" in table
    assert "SMOKE RUN" not in table
    one = bp.new_results(quick=True)
    bp.add_entry(one, "trl", "ppo", entry(0, 0.5, 1.0, 2.0, 10.0))
    assert "50.0%" in bp.table_markdown(one) and "SMOKE RUN" in bp.table_markdown(one)  # one seed: no interval


def test_resume_skips_what_the_json_holds(tmp_path):
    results = fake_results(seeds=(0,))
    del results["trl"]["dpo"][0]
    bp.add_entry(results, "ppo_jax", "ppo", entry(1, 0.6, 2.0, 2.5, 100.0))
    todo = bp.pending(results, (0, 1))
    assert todo[0] == (0, "trl", "dpo")  # seed 0: only the missing cell
    assert [t for t in todo if t[0] == 1] == [(1, lib, m) for m in bp.METHODS for lib in bp.LIBRARIES
                                              if (lib, m) != ("ppo_jax", "ppo")]
    assert bp.pending(fake_results(seeds=(0, 1)), (0, 1)) == []
    assert bp.pending(results, (0,), libraries=("ppo_jax",)) == []

    # The command itself: every asked seed in the JSON -> no stage, no run, no workdir.
    path, workdir = str(tmp_path / "peer.json"), str(tmp_path / "work")
    bp.save_results(fake_results(seeds=(0, 1)), path)
    out = bp.main(["--seeds=2", f"--json={path}", f"--workdir={workdir}"])
    assert not os.path.exists(workdir)
    assert [len(out[lib][m]) for lib in bp.LIBRARIES for m in bp.METHODS] == [2] * 6
    assert len(out["commands"]) == 1 and out["versions"]["jax"]


def test_a_stopped_process_counts_its_pause_and_not_as_training_time():
    """Another job on a shared machine may SIGSTOP this one: the pause is measured, not timed."""
    import signal
    import subprocess
    import time

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); import bench_peer as bp\n"
         "with bp.PauseClock(tick=0.05, gap=0.5) as p:\n    print('ready', flush=True)\n    time.sleep(3)\n"
         "print(p.paused)", os.path.dirname(bp.__file__)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    child.send_signal(signal.SIGSTOP)
    time.sleep(2.0)
    child.send_signal(signal.SIGCONT)
    paused = float(child.communicate(timeout=30)[0])
    assert 1.5 < paused < 2.6
