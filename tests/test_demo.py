"""The offline demo end to end at reduced size (configs/demo_small.py, with the DPO and distillation
stages): the reward model beats chance on gold labels, PPO raises the hidden gold reward with a bounded
KL, DPO and distillation are judged beside it, every promised output is written, preference sampling is reproducible, and the command line
refuses a workdir it did not make."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from conftest import OPTIMISED_TEST_XLA_FLAGS, make_test_mesh

from ppo_jax.demo import kl_sweep, stages
from ppo_jax.demo.evaluator import EvalPoint
from ppo_jax.demo.settings import DemoSettings, small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The reduced demo in a process of its own, with XLA's CPU kernels optimised: its ~1,000 optimizer steps
# run 3x slower under the suite's -O0 (an SFT step of the small model: 87 against 271 ms), which only
# pays where compiling dominates. Alone on 2 cores: 181 s against 287 s for the whole pipeline.
DEMO = """
import pickle, sys
from ppo_jax.demo import pipeline
with open(sys.argv[1], "rb") as f:
    config, workdir = pickle.load(f)
result = pipeline.run(config, workdir, verbose=False)
with open(sys.argv[2], "wb") as f:
    pickle.dump(result, f)
"""


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    config = small_config()
    config.progress = False
    config.run_dpo = True
    config.run_distill = True
    workdir, io = str(tmp_path_factory.mktemp("demo")), tmp_path_factory.mktemp("demo_io")
    with open(io / "in.pkl", "wb") as f:
        pickle.dump((config, workdir), f)
    env = {**os.environ, "XLA_FLAGS": f"{OPTIMISED_TEST_XLA_FLAGS} --xla_force_host_platform_device_count=1",
           "JAX_PLATFORMS": "cpu", "PPO_JAX_HOST_MALLOC": "glibc"}  # the demo's malloc (the suite's: conftest)
    proc = subprocess.run([sys.executable, "-c", DEMO, str(io / "in.pkl"), str(io / "out.pkl")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(io / "out.pkl", "rb") as f:
        return config, pickle.load(f)


def test_direction_rm_beats_chance_gold_goes_up_kl_bounded(result):
    config, r = result
    assert r.rm_val_accuracy > 0.65  # chance is 0.5
    assert r.ppo_gold > r.sft_gold + 0.3
    assert r.ppo_rm_score > r.sft_rm_score
    assert 0.0 <= r.final_kl < config.targets.kl_bound
    assert r.sft_gold < r.best_gold and r.ppo_gold <= r.best_gold + 1e-9
    assert [e.step for e in r.evals] == [0, 10, 20]
    assert abs(r.evals[0].kl) < 1e-3  # before any update the policy is the reference


def test_every_output_is_written(result):
    config, r = result
    w = r.workdir
    for stage in ("sft", "reward_model", "ppo", "dpo"):
        rows = [json.loads(line) for line in open(os.path.join(w, stage, "metrics.jsonl"))]
        assert rows, stage
        assert os.path.isdir(os.path.join(w, stage, "checkpoints")), stage
        assert os.path.isfile(os.path.join(w, stage, "hf", "config.json")), stage
        assert os.path.isfile(os.path.join(w, stage, "hf", "tokenizer.json")), stage
    for name in ("ppo_curves.png", "sft_reward_model.png"):
        with open(os.path.join(w, "plots", name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    before_after = [json.loads(line) for line in open(os.path.join(w, "samples_before_after.jsonl"))]
    assert len(before_after) == config.eval.num_prompts
    assert {"prompt", "sft_response", "ppo_response", "sft_gold", "ppo_gold"} <= set(before_after[0])
    assert np.mean([x["ppo_gold"] for x in before_after]) == pytest.approx(r.ppo_gold)
    samples = [json.loads(line) for line in open(os.path.join(w, "ppo", "samples.jsonl"))]
    assert {s["step"] for s in samples} == {10, 20}
    summary = json.load(open(os.path.join(w, "summary.json")))
    assert summary["rm_val_accuracy"] == r.rm_val_accuracy and "load_average_at_start" in summary
    val = [json.loads(line) for line in open(os.path.join(w, "preferences", "val.jsonl"))]
    assert all(v["gold_chosen"] > v["gold_rejected"] for v in val)  # validation labels are the gold ones
    assert "gold reward, PPO policy" in r.table() and "reward model val accuracy" in r.table()
    # The largest training-rollout KL and its iteration, read from what the trainer logged.
    logged = [(row["objective/kl"], row["step"]) for row in map(json.loads, open(os.path.join(w, "ppo", "metrics.jsonl")))
              if "objective/kl" in row]
    assert len(logged) == config.ppo.train.iterations  # the demo logs every iteration
    assert (summary["max_rollout_kl"], summary["max_rollout_kl_step"]) == pytest.approx(max(logged), rel=1e-6)


def test_dpo_is_judged_beside_ppo(result):
    _, r = result
    d = r.dpo
    assert d is not None and d.kl > 0  # DPO moved the policy away from the SFT reference
    assert d.gap_closed == pytest.approx((d.gold - r.sft_gold) / (r.best_gold - r.sft_gold))
    assert d.val_accuracy > 0.55  # DPO's implicit reward prefers the gold winner more often than chance
    point = json.loads(open(os.path.join(r.workdir, "dpo", "eval.jsonl")).read())
    assert point["gold"] == pytest.approx(d.gold) and point["kl"] == pytest.approx(d.kl)
    summary = json.load(open(os.path.join(r.workdir, "summary.json")))
    assert summary["dpo"]["gold"] == d.gold
    assert "gold reward, DPO policy" in r.table() and "final KL to SFT, DPO" in r.table()


def test_distillation_is_judged_beside_ppo(result):
    """The teacher learned the gold-best answers; distillation's reward pulls the student toward it (its
    reverse KL to the teacher falls); its final policy is judged on PPO's prompts and keys."""
    config, r = result
    d, w = r.distill, r.workdir
    assert d.teacher_gap_closed > 0.5  # the teacher is worth distilling
    rows = [json.loads(line) for line in open(os.path.join(w, "distill", "metrics.jsonl"))]
    teacher_kl = [row["objective/teacher_kl"] for row in rows if "objective/teacher_kl" in row]
    assert len(teacher_kl) == config.ppo.train.iterations
    assert np.mean(teacher_kl[-5:]) < 0.85 * np.mean(teacher_kl[:5])  # 84 -> 58 nats when written
    assert d.teacher_kl == teacher_kl[-1] and not any("objective/scores" in row and row["objective/scores"] != 0
                                                     for row in rows)  # no reward model: the teacher is the reward
    points = [json.loads(line) for line in open(os.path.join(w, "distill", "eval.jsonl"))]
    assert points[0]["gold"] == pytest.approx(r.sft_gold)  # PPO's held-out prompts and sampling keys
    assert points[-1]["gold"] == pytest.approx(d.gold) and d.kl > 1.0
    assert d.gap_closed == pytest.approx((d.gold - r.sft_gold) / (r.best_gold - r.sft_gold))
    assert os.path.isfile(os.path.join(w, "teacher", "hf", "config.json"))
    assert os.path.isfile(os.path.join(w, "distill", "hf", "config.json"))
    summary = json.load(open(os.path.join(w, "summary.json")))
    assert summary["distill"]["gap_closed"] == d.gap_closed and {"teacher", "distill"} <= set(summary["seconds"])
    assert "share of the gap closed by distillation" in r.table()


def test_preference_sampling_is_reproducible(result, tmp_path):
    config, r = result
    settings = DemoSettings.from_config(config)
    again = stages.sample_preferences(settings, os.path.join(r.workdir, "sft", "hf"), str(tmp_path),
                                      make_test_mesh((1, 1, 1)))
    for split, records in zip(("train", "val"), again):
        written = [json.loads(line) for line in open(os.path.join(r.workdir, "preferences", f"{split}.jsonl"))]
        assert records == written, split


def test_command_line_refuses_a_foreign_workdir(tmp_path):
    (tmp_path / "mine.txt").write_text("not the demo's")
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "ppo_jax.demo", f"--workdir={tmp_path}",
                           "--config.ppo.ppo.kl_coef=0.05"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "not empty and was not made by the demo" in proc.stderr
    assert (tmp_path / "mine.txt").exists()


def test_kl_sweep_plot(tmp_path):
    def points(gold, proxy, kl):
        return [EvalPoint(step=10 * i, gold=g, rm_score=p, kl=k, eos_rate=1.0, length=9.0)
                for i, (g, p, k) in enumerate(zip(gold, proxy, kl))]

    evals = {0.0: points([0.2, 1.5, 0.4], [0.0, 1.0, 1.5], [0.0, 5.0, 20.0]),
             0.1: points([0.2, 1.5, 1.6], [0.0, 0.9, 1.0], [0.0, 2.0, 2.5])}
    fig = kl_sweep.plot_sweep(evals, best_gold=2.3125, path=str(tmp_path / "sweep.png"))
    assert len(fig.axes) == 2 and len(fig.axes[0].lines) == 2 * 2 + 1  # gold + proxy per run, best line
    with open(tmp_path / "sweep.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_gold_evaluation_reads_every_sample_of_a_grouped_rollout():
    """With rollout.num_samples = n (GRPO, RLOO) the sampler returns n rows per prompt, prompt i's at
    [i n, (i + 1) n): each is judged against its own prompt (it once indexed past the prompts)."""
    import types

    import jax.numpy as jnp

    from ppo_jax.demo.evaluator import PolicyEvaluator
    from ppo_jax.demo.world import World, topic_of

    world, n = World(), 2
    prompts = world.prompts(2, "eval", seed=0)
    tok = world.tokenizer
    answers = [f"the {topic_of(p)} is lovely , warm and bright ." for p in prompts]  # each about its own prompt
    ids = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in answers]
    width = max(map(len, ids))
    rows = np.asarray([i + [tok.pad_token_id] * (width - len(i)) for i in ids for _ in range(n)], np.int32)
    mask = (np.arange(width) < np.asarray([len(i) for i in ids for _ in range(n)])[:, None]).astype(np.int32)

    def sample(prompt_tokens, prompt_mask, key):
        return types.SimpleNamespace(prompt_tokens=jnp.repeat(prompt_tokens, n, 0), prompt_mask=jnp.repeat(prompt_mask, n, 0),
                                     tokens=jnp.asarray(rows), mask=jnp.asarray(mask), logprobs=jnp.zeros(rows.shape))

    trainer = types.SimpleNamespace(
        settings=types.SimpleNamespace(rollout=types.SimpleNamespace(batch_size=2, num_samples=n),
                                       data=types.SimpleNamespace(prompt_length=10)),
        tokenizer=tok, meshes=types.SimpleNamespace(sampler=make_test_mesh((1, 1, 1))), stop_ids=(tok.eos_token_id,),
        sample=sample,
        score_responses=lambda *a: (jnp.zeros(rows.shape), jnp.zeros(len(rows))))
    point, judged = PolicyEvaluator(trainer, world, prompts, seed=0)(0)
    assert [r["prompt"] for r in judged] == [prompts[0]] * n + [prompts[1]] * n
    assert point.gold == pytest.approx(world.best_gold)  # each answer names its own prompt's topic
