"""Never lose a run: exact resume after a real SIGTERM, the non-finite guard, the preemption path of
the CLI, export of a trained policy, and bad input that must fail before anything is written."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import torch
import transformers
from conftest import TEST_XLA_FLAGS, make_test_mesh
from test_trainer import REPO
from tiny_configs import tiny_config

from ppo_jax import reward_functions as reward_fns
from ppo_jax.checkpoint import CheckpointCorruptError
from ppo_jax.rl.export import export_checkpoint
from ppo_jax.rl.errors import PREEMPTION_NOTICE, NonFiniteError, RunFailedError, RunStopped
from ppo_jax.rl.trainer import PPOTrainer

ITERATIONS = 4


def _toy_reward_then_sigterm_at(call: int):
    """The toy reward; on its `call`-th call the process sends itself a real SIGTERM."""
    calls = {"n": 0}

    def reward(prompts, responses):
        calls["n"] += 1
        if calls["n"] == call:
            os.kill(os.getpid(), signal.SIGTERM)
        return reward_fns.toy_target_count(prompts, responses)

    return reward


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith(("time/", "perf/"))}


def test_resume_after_sigterm_is_bitwise_identical(tmp_path):
    def config():
        return tiny_config(**{"train.iterations": ITERATIONS, "optim.schedule": "cosine",
                              "optim.warmup_steps": 2, "ppo.kl_controller": "adaptive"})

    mesh = make_test_mesh((1, 1, 1))
    straight = PPOTrainer(config(), str(tmp_path / "straight"), mesh=mesh,
                          reward_functions=[(reward_fns.toy_target_count, 1.0)])
    expected = straight.train()
    expected_params = jax.device_get(straight.state)
    straight.close()

    workdir = str(tmp_path / "interrupted")
    first = PPOTrainer(config(), workdir, mesh=mesh, reward_functions=[(_toy_reward_then_sigterm_at(2), 1.0)])
    partial = first.train()
    assert first.stopped_by == "SIGTERM" and len(partial) == 2
    first.close()

    resumed = PPOTrainer(config(), workdir, mesh=mesh, reward_functions=[(reward_fns.toy_target_count, 1.0)])
    assert resumed.resumed_from == 2
    rest = resumed.train()
    assert len(rest) == ITERATIONS - 2
    for want, got in zip(expected[2:], rest):
        assert _comparable(got) == _comparable(want)  # bitwise: exact float equality
    got_params = jax.device_get(resumed.state)
    for a, b in zip(jax.tree.leaves(expected_params.policy) + jax.tree.leaves(expected_params.value),
                    jax.tree.leaves(got_params.policy) + jax.tree.leaves(got_params.value)):
        np.testing.assert_array_equal(a, b)
    assert float(got_params.kl.coef) == float(expected_params.kl.coef)
    resumed.close()
    # No step logged twice, none missing.
    steps = [json.loads(line)["step"] for line in open(os.path.join(workdir, "metrics.jsonl"))]
    assert steps == list(range(1, ITERATIONS + 1))

    # The trained policy exports to a Hugging Face directory whose logits match ours.
    out = export_checkpoint(workdir, str(tmp_path / "hf"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ids = np.array([[5, 9, 7, 11, 2, 6]], np.int32)
    with torch.no_grad():
        theirs = model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    ours, _ = resumed.modules.policy.apply({"params": jax.device_get(resumed.state.policy)}, ids,
                                           np.arange(6)[None], np.ones_like(ids))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4)


def test_nonfinite_rewards_skip_updates_then_stop_with_checkpoint_intact(tmp_path):
    calls = {"n": 0}

    def poisoned(prompts, responses):
        calls["n"] += 1
        scores = np.asarray(reward_fns.toy_target_count(prompts, responses), np.float32)
        if calls["n"] >= 2:  # from the second iteration on, one row's reward is NaN
            scores[3] = np.nan
        return scores

    config = tiny_config(**{"train.iterations": 6, "train.max_consecutive_nonfinite": 2,
                            "train.checkpoint_every": 1})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(poisoned, 1.0)])
    with pytest.raises(NonFiniteError, match=r"2 consecutive iterations had non-finite .* the last good "
                                             r"checkpoint, step 1 in .* is intact"):
        trainer.train()
    history = trainer.history
    assert history[0]["nonfinite/skipped_minibatches"] == 0
    assert [h["nonfinite/skipped_minibatches"] for h in history[1:]] == [4.0, 4.0]  # 2 epochs x 2 minibatches
    # Skipped updates leave the parameters exactly as they were after step 1.
    restored, _ = trainer.checkpoints.restore(1, abstract_state=trainer.abstract_state)
    for a, b in zip(jax.tree.leaves(jax.device_get(restored.policy)),
                    jax.tree.leaves(jax.device_get(trainer.state.policy))):
        np.testing.assert_array_equal(a, b)
    assert trainer.checkpoints.all_steps() == [1]
    rows = [json.loads(line) for line in open(tmp_path / "nonfinite_samples.jsonl")]
    assert {r["row"] for r in rows} == {3} and all(r["score"] != r["score"] for r in rows)  # NaN
    trainer.close()


def test_a_nonfinite_last_iteration_still_saves_and_is_not_called_done(tmp_path):
    """The final save happens with the last good parameters, and the run says it ended on skipped
    updates (an error, so the CLI exits non-zero), never "done"."""
    calls = {"n": 0}

    def poisoned_last(prompts, responses):
        calls["n"] += 1
        scores = np.asarray(reward_fns.toy_target_count(prompts, responses), np.float32)
        if calls["n"] == 2:
            scores[0] = np.inf
        return scores

    config = tiny_config(**{"train.iterations": 2})  # checkpoint_every = 0: only the final save
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(poisoned_last, 1.0)])
    with pytest.raises(NonFiniteError, match=r"ended on 1 iteration\(s\) whose updates were skipped.*"
                                             r"checkpoint step 2"):
        trainer.train()
    assert trainer.checkpoints.all_steps() == [2]
    restored, _ = trainer.checkpoints.restore(2, abstract_state=trainer.abstract_state)
    for saved, live in zip(jax.tree.leaves(jax.device_get(restored.policy)),
                           jax.tree.leaves(jax.device_get(trainer.state.policy))):
        assert np.isfinite(saved).all()
        np.testing.assert_array_equal(saved, live)
    trainer.close()


def test_an_update_that_makes_parameters_nonfinite_stops_before_saving(tmp_path):
    """A learning rate near float32's largest value with weight decay: gradients stay finite, the
    AdamW step lr * (adam + decay * p) overflows to inf. The step-finite check stops the run, and
    nothing non-finite is ever saved."""
    config = tiny_config(**{"train.iterations": 3, "train.checkpoint_every": 1, "optim.policy_lr": 3e38,
                            "optim.weight_decay": 1.0, "optim.max_grad_norm": 0.0})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    with pytest.raises(NonFiniteError, match="iteration 1's update produced non-finite parameters.*"
                                             "not saved; no checkpoint was saved"):
        trainer.train()
    assert trainer.checkpoints.all_steps() == []
    trainer.close()


def test_export_refuses_nonfinite_parameters(tmp_path):
    config = tiny_config(**{"train.iterations": 1})
    trainer = PPOTrainer(config, str(tmp_path / "run"), mesh=make_test_mesh((1, 1, 1)))
    trainer.train()
    _, extra = trainer.checkpoints.read_extra(1)
    state = trainer.state
    poisoned = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(np.nan), state.policy)
    trainer.checkpoints.save(2, state.replace(policy=poisoned, step=state.step + 1), extra=extra, force=True)
    trainer.close()
    with pytest.raises(ValueError, match="checkpoint step 2 .* holds non-finite policy parameters"):
        export_checkpoint(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()
    assert os.path.isdir(export_checkpoint(str(tmp_path / "run"), str(tmp_path / "hf"), step=1))


def test_rerunning_a_finished_run_says_it_is_complete(tmp_path):
    from ppo_jax.cli.train import train

    config = tiny_config(**{"train.iterations": 1})
    first = train(config, str(tmp_path))
    assert first.startswith("done: 1 iterations")
    again = train(config, str(tmp_path))
    assert again.startswith("already complete: checkpoint step 1 of train.iterations=1")


def test_a_run_killed_before_its_first_checkpoint_logs_every_step_once(tmp_path):
    """Metrics and samples written by a run that died before any checkpoint are dropped when the
    next run starts over, so every step appears once (not [1, 2, 1, 2, 3])."""
    config = tiny_config(**{"train.iterations": 2, "train.sample_every": 1})

    def killed_at_step_2(step, scalars):
        if step == 2:  # BaseException: nothing catches it, like a hard kill (no emergency save)
            raise KeyboardInterrupt
        return None

    first = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    with pytest.raises(KeyboardInterrupt):
        first.train(on_iteration=killed_at_step_2)
    first.close()
    assert [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [1]
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "objective/sco')  # a row cut short by the kill
    second = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    assert second.resumed_from is None
    second.train()
    second.close()
    assert [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [1, 2]
    sample_steps = [r["step"] for r in map(json.loads, open(tmp_path / "samples.jsonl"))]
    assert sorted(set(sample_steps)) == [1, 2] and sample_steps == sorted(sample_steps)
    assert sample_steps.count(1) == sample_steps.count(2)


def _reward_raising_at(call: int):
    calls = {"n": 0}

    def reward(prompts, responses):
        calls["n"] += 1
        if calls["n"] == call:
            raise ZeroDivisionError("the reward server divided by zero")
        return reward_fns.toy_target_count(prompts, responses)

    return reward


def test_an_exception_mid_run_saves_the_last_good_state_first(tmp_path):
    """checkpoint_every=0: without the emergency save, iterations 1-2 would be lost."""
    config = tiny_config(**{"train.iterations": 4})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(_reward_raising_at(3), 1.0)])
    with pytest.raises(RunFailedError, match=r"iteration 3 failed with ZeroDivisionError: the reward server "
                                             r"divided by zero; checkpoint step 2 in .* holds the last good state"
                                             r".*traceback in .*error.log") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert trainer.checkpoints.all_steps() == [2]
    log = (tmp_path / "error.log").read_text()
    assert "iteration 3 failed" in log and "Traceback" in log and "ZeroDivisionError" in log
    trainer.close()
    resumed = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(reward_fns.toy_target_count, 1.0)])
    assert resumed.resumed_from == 2
    assert len(resumed.train()) == 2
    resumed.close()
    assert [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]


def test_an_exception_in_the_first_iteration_saves_nothing_and_says_so(tmp_path):
    trainer = PPOTrainer(tiny_config(**{"train.iterations": 2}), str(tmp_path), mesh=make_test_mesh((1, 1, 1)),
                         reward_functions=[(_reward_raising_at(1), 1.0)])
    with pytest.raises(RunFailedError, match="iteration 1 failed .* no iteration completed, nothing was saved"):
        trainer.train()
    assert trainer.checkpoints.all_steps() == []
    trainer.close()


def test_cli_reports_a_failing_reward_function_in_one_line(tmp_path):
    (tmp_path / "flaky_reward.py").write_text(
        "CALLS = [0]\n"
        "def score(prompts, responses):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] == 2:\n"
        "        raise RuntimeError('reward service unavailable')\n"
        "    return [float(len(r)) for r in responses]\n")
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_jax.cli.train", f"--config={REPO}/configs/ppo_toy.py",
           f"--workdir={workdir}", "--config.train.iterations=3", "--config.train.progress=False",
           "--config.reward.functions=flaky_reward:score", "--config.rollout.batch_size=8",
           "--config.rollout.response_length=4", "--config.data.prompt_length=8", "--config.ppo.epochs=1"]
    env = {**os.environ, "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # Nothing else on the terminal: no library INFO lines, no advice, no traceback.
    assert proc.stderr.strip().splitlines() == error_lines and not proc.stdout.strip(), proc.stderr[-3000:]
    assert len(error_lines) == 1 and "iteration 2 failed with RuntimeError: reward service unavailable" \
        in error_lines[0] and "checkpoint step 1" in error_lines[0], proc.stderr[-3000:]
    assert "RuntimeError" in (workdir / "error.log").read_text()
    assert sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit()) == [1]


def _flip_bytes_in_largest_array_file(tree_dir):
    files = [p for p in tree_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    path = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = bytes(8)
    path.write_bytes(bytes(data))


def _assert_same_params(a, b):
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        np.testing.assert_array_equal(x, y)


def test_resume_skips_a_damaged_newest_step_and_says_so(tmp_path, capsys):
    config = tiny_config(**{"train.iterations": 2, "train.checkpoint_every": 1})
    PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1))).train()
    _flip_bytes_in_largest_array_file(tmp_path / "checkpoints" / "2" / "state")
    (tmp_path / "checkpoints" / "99").mkdir()  # named like a step, holds no checkpoint: set aside too
    (tmp_path / "checkpoints" / "99" / "x").write_text("not a checkpoint")
    capsys.readouterr()
    resumed = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    out = capsys.readouterr().out
    assert resumed.resumed_from == 1
    [junk] = [line for line in out.splitlines() if line.startswith("warning: ") and "/99 " in line]
    assert "holds none (no _CHECKPOINT_METADATA file, no state/ directory; it holds x)" in junk
    # Which check catches the zeroed bytes depends on where they land in the compressed file (its
    # layout varies run to run): the checksums, or the decoder while reading. Either says "is damaged".
    assert "warning: checkpoint step 2 in" in out and " is damaged: " in out and "2.corrupt" in out \
        and "resuming from step 1" in out
    assert len(resumed.train()) == 1  # step 2 again
    resumed.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1", "2", "2.corrupt", "99.corrupt", "frozen"]
    assert [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_a_frozen_reference_is_tied_to_its_run(tmp_path, capsys):
    """A kill between the reference's commit and the first step's, a reused workdir, and a damaged
    or lost reference: the run adopts the reference only when it is its own initial policy."""
    config = tiny_config(**{"train.iterations": 1})
    mesh = make_test_mesh((1, 1, 1))
    first = PPOTrainer(config, str(tmp_path), mesh=mesh)
    first.train()
    first.close()
    reference = tmp_path / "checkpoints" / "frozen" / "reference"

    # A kill after the reference committed, before step 1 did: the same run adopts it as it is.
    shutil.rmtree(tmp_path / "checkpoints" / "1")
    again = PPOTrainer(config, str(tmp_path), mesh=mesh)
    assert again.resumed_from is None and again.checkpointing.reference_saved
    again.train()
    again.close()
    _assert_same_params(again.frozen.reference, first.frozen.reference)

    # The workdir reused by a run with another seed (and no steps): that reference is not adopted.
    shutil.rmtree(tmp_path / "checkpoints" / "1")
    capsys.readouterr()
    other_seed = PPOTrainer(tiny_config(**{"train.iterations": 1, "seed": 7}), str(tmp_path), mesh=mesh)
    assert "is not this run's initial policy" in capsys.readouterr().out
    assert (reference.parent / "reference.stale").is_dir() and not reference.exists()
    other_seed.train()  # saves its own
    other_seed.close()
    shutil.rmtree(tmp_path / "checkpoints")

    # With steps: a damaged reference is rebuilt from its source and proven equal to the original.
    first = PPOTrainer(config, str(tmp_path), mesh=mesh)
    first.train()
    first.close()
    _flip_bytes_in_largest_array_file(reference)
    capsys.readouterr()
    resumed = PPOTrainer(tiny_config(**{"train.iterations": 2}), str(tmp_path), mesh=mesh)
    out = capsys.readouterr().out
    assert "frozen tree 'reference'" in out and "rebuilt the reference policy from the seed" in out
    _assert_same_params(resumed.frozen.reference, first.frozen.reference)
    resumed.train()
    resumed.close()
    assert reference.is_dir() and (reference.parent / "reference.corrupt").is_dir()

    # A lost reference that the config can no longer rebuild (the seed changed): refused.
    shutil.rmtree(reference)
    with pytest.raises(CheckpointCorruptError, match="no frozen tree 'reference'.*does not give the tree the "
                                                    "checkpoints were trained against"):
        PPOTrainer(tiny_config(**{"train.iterations": 3, "seed": 7}), str(tmp_path), mesh=mesh)


def test_cli_ctrl_c_saves_says_how_to_resume_and_exits_130(tmp_path):
    """SIGINT (Ctrl-C) with the progress bar on: the message on its own line, the checkpoint of the
    last logged step, and status 130 so a wrapper tells it from a finished run (SIGTERM: 143)."""
    workdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ppo_jax.cli.train", f"--config={REPO}/configs/ppo_toy.py",
           f"--workdir={workdir}", "--config.train.iterations=1000", "--config.train.progress=True",
           "--config.rollout.batch_size=8", "--config.rollout.response_length=4",
           "--config.data.prompt_length=8", "--config.ppo.epochs=1"]
    env = {**os.environ, "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count=1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the run never logged a step"
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, output[-3000:]
    stopped = [line for line in output.split("\n") if "Stopped by SIGINT" in line]
    assert len(stopped) == 1 and stopped[0].startswith("Stopped by SIGINT after iteration "), output[-3000:]
    assert "Run the same command again to resume" in stopped[0]
    steps = sorted(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    assert steps and steps[-1] == json.loads(metrics.read_text().splitlines()[-1])["step"]


def test_stop_exit_statuses():
    assert [RunStopped(r).exit_status for r in ("SIGINT", "SIGTERM", PREEMPTION_NOTICE)] == [130, 143, 143]


# ---------------------------------------------------------------------------------------------
# Bad input: each case fails with its message and writes nothing.


def _hf_dir(tmp_path, name="policy"):
    """A tiny GPT-2 with a word tokenizer (pad != eos) saved as a Hugging Face directory."""
    from ppo_jax.data import toy

    tok = toy.tokenizer(32)
    cfg = transformers.GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    path = tmp_path / name
    transformers.GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


def _expect_error(config, tmp_path, match, **kwargs):
    workdir = tmp_path / "workdir"
    with pytest.raises(Exception, match=match):
        PPOTrainer(config, str(workdir), mesh=make_test_mesh((1, 1, 1)), **kwargs)
    assert not workdir.exists()


def test_nonexistent_policy_path(tmp_path):
    _expect_error(tiny_config(**{"policy.path": str(tmp_path / "nope")}), tmp_path, "does not exist")


def test_empty_prompt_file(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    _expect_error(tiny_config(**{"data.prompts": str(tmp_path / "empty.jsonl")}), tmp_path, "empty")


def test_malformed_prompt_file_names_the_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "w1 w2"}\n{"prompt": oops}\n')
    _expect_error(tiny_config(**{"data.prompts": str(tmp_path / "p.jsonl")}), tmp_path, r"p.jsonl:2")


def test_prompt_longer_than_limit_with_error_policy(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(" ".join(["w1"] * 20) + "\n")
    config = tiny_config(**{"data.prompts": str(path), "data.truncation": "error"})
    _expect_error(config, tmp_path, r"p.txt:1: .*has 20 tokens, more than max_prompt_length=8")


def test_tokenizer_without_pad_token(tmp_path):
    from ppo_jax.data import toy

    tok = toy.tokenizer(32)
    tok.pad_token = None
    _expect_error(tiny_config(), tmp_path, "no pad token", tokenizer=tok)


def test_policy_and_reward_tokenizers_differ(tmp_path):
    policy, _ = _hf_dir(tmp_path)
    other = transformers.GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=32,
                                    pad_token_id=0, num_labels=1)
    transformers.GPT2ForSequenceClassification(other).save_pretrained(tmp_path / "rm")
    from ppo_jax.data import build_word_tokenizer

    build_word_tokenizer([f"v{i}" for i in range(36)]).save_pretrained(tmp_path / "rm")
    config = tiny_config(**{"policy.path": str(policy), "reward.path": str(tmp_path / "rm")})
    _expect_error(config, tmp_path, "tokenizers differ")


def test_corrupt_safetensors(tmp_path):
    policy, _ = _hf_dir(tmp_path)
    weights = policy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    _expect_error(tiny_config(**{"policy.path": str(policy)}), tmp_path, "model.safetensors")


def test_checkpoint_from_a_different_model_shape(tmp_path):
    config = tiny_config(**{"train.iterations": 1})
    trainer = PPOTrainer(config, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
    trainer.train()
    trainer.close()
    wider = tiny_config(**{"train.iterations": 2})
    wider.policy.model.hidden_size = 64
    with pytest.raises(Exception, match=r"policy.*(64|32)"):
        PPOTrainer(wider, str(tmp_path), mesh=make_test_mesh((1, 1, 1)))
