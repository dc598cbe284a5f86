"""DPO trainer: each loss and its gradient against NumPy implementations of the papers' formulas; our
per-sequence log-probs equal transformers' on the same weights; at step 0 (policy = reference) the
sigmoid loss is log 2 and the margins 0; the update does not depend on the microbatch count or the mesh;
it learns a preference; a resumed run equals an uninterrupted one; bad configs fail before compiling."""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from conftest import make_test_mesh, tiny_supervised_config
from conftest import preference_tokenizer as tokenizer

from ppo_jax import sharding
from ppo_jax.config import ConfigError
from ppo_jax.models import CausalLM, hf, init_params
from ppo_jax.ppo.stats import finalize_metrics
from ppo_jax.supervised import base as supervised
from ppo_jax.supervised.dpo import DPOTrainer, dpo_config, make_loss_fn, sequence_logps
from ppo_jax.supervised.dpo_loss import Pair, dpo_loss

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
def pairs(n, seed=0):
    """Chosen answers say 'good', rejected ones 'bad'; answers differ in length, so token counts vary."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = " ".join(f"w{i}" for i in rng.integers(1, 40, size=rng.integers(2, 5))) + " ?"
        good = [f"w{i}" for i in rng.integers(1, 40, size=rng.integers(1, 4))] + ["good"]
        bad = [f"w{i}" for i in rng.integers(1, 40, size=rng.integers(1, 4))] + ["bad"]
        out.append({"prompt": prompt, "chosen": " ".join(good), "rejected": " ".join(bad)})
    return out


# ----------------------------------------------------------------------------------------------
# The losses against NumPy.


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def numpy_dpo(pc, pr, rc, rr, *, tc, tr, loss_type, beta, label_smoothing=0.0, sft_coef=0.0):
    """The papers' formulas, float64: DPO (Rafailov et al. eq. 7), conservative DPO (Mitchell), IPO
    (Azar et al. eq. 17, empirical form, on per-token mean log-ratios), plus sft_coef x the token-mean
    NLL of the chosen answers. tc, tr: response token counts."""
    if loss_type == "sigmoid":
        h = (pc - rc) - (pr - rr)
        per_pair = -(1 - label_smoothing) * log_sigmoid(beta * h) - label_smoothing * log_sigmoid(-beta * h)
    else:
        h = (pc - rc) / tc - (pr - rr) / tr
        per_pair = (h - 1 / (2 * beta)) ** 2
    loss = per_pair.mean()
    if sft_coef:
        loss += sft_coef * (-pc.sum()) / tc.sum()
    return loss


CASES = {
    "sigmoid": dict(loss_type="sigmoid", beta=0.1),
    "sigmoid_large_beta": dict(loss_type="sigmoid", beta=2.0),
    "conservative": dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.2),
    "ipo": dict(loss_type="ipo", beta=0.1),
    "sigmoid_with_sft": dict(loss_type="sigmoid", beta=0.1, sft_coef=0.7),
    "ipo_with_sft": dict(loss_type="ipo", beta=0.5, sft_coef=1.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_and_gradient_match_numpy(name):
    kw = CASES[name]
    rng = np.random.default_rng(0)
    b = 32
    tc, tr = (rng.integers(1, 12, size=b).astype(np.float64) for _ in range(2))
    pc, pr = -tc * rng.uniform(0.5, 3, b), -tr * rng.uniform(0.5, 3, b)
    rc, rr = pc + rng.normal(0, 3, b), pr + rng.normal(0, 3, b)
    tokens = Pair(chosen=jnp.asarray(tc, jnp.float32), rejected=jnp.asarray(tr, jnp.float32))

    def ours(pc, pr, rc, rr):
        return dpo_loss(Pair(chosen=pc, rejected=pr), Pair(chosen=rc, rejected=rr), tokens, **kw)[0]

    f32 = [jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)]
    loss, grads = jax.value_and_grad(ours, argnums=(0, 1, 2, 3))(*f32)
    expected = numpy_dpo(pc, pr, rc, rr, tc=tc, tr=tr, **kw)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # Central differences of the float64 formula (exact to ~1e-9 at this step).
    eps = 1e-5
    for which, grad in ((0, grads[0]), (1, grads[1])):
        numeric = np.zeros(b)
        for i in range(b):
            up, down = [np.array(x) for x in (pc, pr, rc, rr)], [np.array(x) for x in (pc, pr, rc, rr)]
            up[which][i] += eps
            down[which][i] -= eps
            numeric[i] = (numpy_dpo(*up, tc=tc, tr=tr, **kw) - numpy_dpo(*down, tc=tc, tr=tr, **kw)) / (2 * eps)
        np.testing.assert_allclose(np.asarray(grad), numeric, rtol=1e-4, atol=1e-7)
    # The reference is a constant: no gradient reaches it.
    assert not np.any(np.asarray(grads[2])) and not np.any(np.asarray(grads[3]))


def test_metrics_have_trls_names_and_values():
    rng = np.random.default_rng(1)
    pc, pr, rc, rr = (rng.normal(-10, 4, 16) for _ in range(4))
    pc[0], rc[0], pr[0], rr[0] = -5.0, -5.0, -7.0, -7.0  # a tie: counts as not accurate
    weight = np.ones(16)
    weight[-3:] = 0  # filler rows
    beta = 0.3
    ones = Pair(jnp.ones(16), jnp.ones(16))
    _, metrics = dpo_loss(Pair(jnp.asarray(pc), jnp.asarray(pr)), Pair(jnp.asarray(rc), jnp.asarray(rr)), ones,
                          beta=beta, weight=jnp.asarray(weight))
    m = {k: float(v) for k, v in finalize_metrics(metrics).items()}
    real = weight == 1
    chosen, rejected = beta * (pc - rc)[real], beta * (pr - rr)[real]
    expected = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
                "rewards/accuracies": (chosen > rejected).mean(), "rewards/margins": (chosen - rejected).mean(),
                "logps/chosen": pc[real].mean(), "logps/rejected": pr[real].mean()}
    for k, v in expected.items():
        assert m[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_bad_loss_type_in_the_pure_function():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        zeros = Pair(jnp.zeros(2), jnp.zeros(2))
        dpo_loss(zeros, zeros, zeros, loss_type="hinge")


# ----------------------------------------------------------------------------------------------
# Per-sequence log-probs against PyTorch.


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_sequence_logps_match_pytorch(arch, tmp_path):
    vocab, length = 64, 12
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=32))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random (default init hides misplaced biases and norms)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.eval().save_pretrained(tmp_path)

    # Left-padded prompt + response rows: (padding, prompt, response) lengths per row.
    rng = np.random.default_rng(0)
    layout = [(0, 4, 8), (3, 5, 4), (6, 2, 4), (9, 2, 1)]
    tokens = np.zeros((len(layout), length), np.int32)
    mask, response = np.zeros_like(tokens), np.zeros_like(tokens)
    for row, (pad, prompt, resp) in enumerate(layout):
        tokens[row, pad:] = rng.integers(1, vocab, length - pad)
        mask[row, pad:] = 1
        response[row, pad + prompt:] = 1

    mesh = make_test_mesh((1, 1, 1))
    loaded = hf.load_model(str(tmp_path), mesh, kind="causal_lm")
    with sharding.mesh_context(mesh):
        logps, counts = jax.jit(lambda p, t, m, r: sequence_logps(loaded.module, p, t, m, r))(
            loaded.params, tokens, mask, response)

    with torch.no_grad():
        ids, m = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
        logits = model(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - m).clamp(min=0)).logits
        picked = torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        expected = (picked * torch.tensor(response[:, 1:])).sum(-1).numpy()
    np.testing.assert_allclose(np.asarray(logps), expected, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(counts), [r for _, _, r in layout])


# ----------------------------------------------------------------------------------------------
# The trainer.


def tiny_config(model_path="", **overrides):
    return tiny_supervised_config(dpo_config(), model_path, **{"data.max_response_length": 6, "train.export": False,
                                                              **overrides})


def make(config, workdir, mesh_shape=(1, 1, 1), n=64, **kw):
    kw.setdefault("train_records", pairs(n))
    return DPOTrainer(config, str(workdir), tokenizer=tokenizer(), mesh=make_test_mesh(mesh_shape), **kw)


@pytest.fixture(scope="module")
def trained(sft_dir, tmp_path_factory):
    """DPO from the SFT model on 'good' > 'bad', evaluated at 20 and 40 steps, exported."""
    workdir = tmp_path_factory.mktemp("dpo")
    config = tiny_config(sft_dir, **{"train.steps": 40, "train.log_every": 10, "train.eval_every": 20,
                                     "train.export": True})
    trainer = make(config, workdir, n=256, eval_records=pairs(40, seed=5))
    start = trainer.evaluate()
    first = trainer.train_step()
    history = trainer.train()
    return trainer, start, first, history, workdir


def test_at_step_0_the_policy_is_the_reference(trained):
    _, start, first, _, _ = trained
    for metrics, prefix in ((first, ""), (start, "eval/")):
        assert metrics[f"{prefix}loss"] == pytest.approx(math.log(2), abs=1e-6)
        for name in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(metrics[f"{prefix}{name}"]) < 1e-6, name
        assert metrics[f"{prefix}rewards/accuracies"] == 0.0  # every margin a tie
    assert first["logps/chosen"] < 0 and first["logps/rejected"] < 0
    assert start["eval/pairs"] == 40


def test_learns_the_preference_logs_trl_names_and_exports(trained, sft_dir):
    trainer, _, _, history, workdir = trained
    evals = [r for r in history if "eval/loss" in r]
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["eval/rewards/accuracies"] > 0.9 and evals[-1]["eval/loss"] < math.log(2) - 0.1
    assert evals[-1]["eval/rewards/margins"] > 0
    rows = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                 "logps/chosen", "logps/rejected", "grad_norm"):
        assert name in rows[0], name
    assert os.path.isdir(workdir / "tensorboard") and os.path.isdir(workdir / "checkpoints" / "40")
    # The export is a transformers causal LM whose log-probs are the trained policy's.
    model = transformers.GPT2LMHeadModel.from_pretrained(str(workdir / "hf")).eval()
    batch = trainer.prompt_tokenizer.preferences(pairs(4, seed=9), length=trainer.length)
    ours = np.asarray(trainer._reference_logps(trainer.params, trainer._place(batch)).chosen)
    with torch.no_grad():
        ids, m = torch.tensor(batch.chosen_tokens, dtype=torch.long), torch.tensor(batch.chosen_mask, dtype=torch.long)
        logits = model(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - m).clamp(min=0)).logits
        picked = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        theirs = (picked * torch.tensor(batch.chosen_response_mask[:, 1:])).sum(-1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    # The reference never moved.
    lm = hf.load_model(sft_dir, make_test_mesh((1, 1, 1)), kind="causal_lm")
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.reference), jax.device_get(lm.params))


def test_gradients_do_not_depend_on_the_microbatch_count(sft_dir, tmp_path):
    """With the NLL term on (token-normalised) and answers of uneven length, 1 and 4 microbatches
    give the same loss, metrics and gradient."""
    trainer = make(tiny_config(sft_dir, **{"loss.sft_coef": 0.5}), tmp_path)
    # One step first: at policy = reference every margin is a tie, broken by rounding differently
    # for different row counts, and rewards/accuracies would count float noise.
    trainer.train_step()
    batch = trainer._device_batch(next(trainer.loader))
    hp = trainer.settings.loss
    num_tokens = batch.pairs.chosen_response_mask.sum().astype(jnp.float32)

    def totals(n):
        def fn(params, batch):
            return supervised.accumulate_gradients(
                lambda p, mb: make_loss_fn(trainer.module, hp, mb, num_pairs=16, num_tokens=num_tokens)(p),
                params, supervised.split_microbatches(batch, n), sharding.data_sharding(trainer.mesh))
        with sharding.mesh_context(trainer.mesh):
            loss, metrics, grads = jax.jit(fn)(trainer.params, batch)
        return float(loss), {k: float(v) for k, v in finalize_metrics(metrics).items()}, grads

    one, four = totals(1), totals(4)
    assert one[0] == pytest.approx(four[0], rel=1e-6)
    for k in one[1]:
        assert one[1][k] == pytest.approx(four[1][k], rel=1e-5, abs=1e-6), k
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7),
                 one[2], four[2])
    trainer.close()


def test_two_steps_are_the_same_for_every_mesh_and_microbatch_count(sft_dir, tmp_path):
    results = []
    for shape, micro in [((1, 1, 1), 1), ((2, 2, 2), 2)]:
        config = tiny_config(sft_dir, **{"loss.sft_coef": 0.5, "train.num_microbatches": micro})
        trainer = make(config, tmp_path / f"{micro}", mesh_shape=shape)
        first, second = trainer.train_step(), trainer.train_step()
        # The second loss is computed with the updated params, so it checks the update as well.
        results.append((first["loss"], first["grad_norm"], first["nll_loss"], second["loss"],
                        second["rewards/margins"]))
        trainer.close()
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def test_resumed_run_equals_uninterrupted_run_and_refuses_another_reference(tmp_path):
    config = tiny_config(**{"train.steps": 6})
    uninterrupted = make(config, tmp_path)
    for step in range(1, 7):
        uninterrupted.train_step()
        if step == 3:
            uninterrupted.save(3)  # the checkpoint an interrupted run would have left
    uninterrupted.close()
    resumed = make(config, tmp_path)  # the same workdir: picks up step 3 and the data position
    assert resumed.step == 3
    resumed.train()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 jax.device_get(resumed.params), jax.device_get(uninterrupted.params))
    # Another initial model (here: another seed of a fresh one) is another reference: refused.
    config.seed = 1
    with pytest.raises(ConfigError, match="trained against another reference"):
        make(config, tmp_path)


@pytest.mark.parametrize("overrides, message", [
    ({"loss.beta": 0.0}, "loss.beta must be > 0"),
    ({"loss.type": "hinge"}, "loss.type='hinge'"),
    ({"loss.label_smoothing": 0.5}, r"loss.label_smoothing must be in \[0, 0.5\)"),
    ({"loss.type": "ipo", "loss.label_smoothing": 0.1}, "applies to loss.type='sigmoid' only"),
    ({"loss.sft_coef": -1.0}, "loss.sft_coef must be >= 0"),
    ({"train.num_microbatches": 3}, "does not split into train.num_microbatches=3"),
    ({"train.num_microbatches": 8}, "a microbatch of 2 pairs .* does not split over the 4"),
])
def test_bad_configs_fail_before_anything_compiles(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make(tiny_config(**overrides), tmp_path / "run", mesh_shape=(2, 2, 1))
    assert not (tmp_path / "run").exists()


def test_command_line_rejects_a_bad_value_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "ppo_jax.cli.dpo", f"--config={REPO}/configs/dpo.py",
                          f"--workdir={tmp_path}/run", "--config.loss.beta=-0.1"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr == "error: dpo: loss.beta must be > 0, got -0.1\n"
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# TRL (a test-only dependency: skipped where it is not installed; the NumPy tests above are not).


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_equals_trls_dpo_trainer_on_its_own_batch(loss_type, sft_dir, tmp_path):
    """TRL's DPOTrainer tokenizes and collates a batch and computes its loss (policy and reference two
    different models, so the loss is not log 2); ours on the same token ids and weights agrees."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = tokenizer()
    cfg = hf.load_config(sft_dir)[0]
    ref_params, _ = init_params(CausalLM(cfg), jax.random.key(2), make_test_mesh((1, 1, 1)))
    ref_dir = str(tmp_path / "ref")
    hf.export_model(ref_dir, cfg, ref_params, kind="causal_lm", tokenizer=tok)
    # TRL joins prompt and answer as text: the answers carry the separating space.
    records = [{**r, "chosen": " " + r["chosen"], "rejected": " " + r["rejected"]} for r in pairs(8, seed=3)]
    beta = 0.3
    trainer = trl.DPOTrainer(
        model=transformers.GPT2LMHeadModel.from_pretrained(sft_dir),
        ref_model=transformers.GPT2LMHeadModel.from_pretrained(ref_dir),
        args=trl.DPOConfig(output_dir=str(tmp_path / "trl"), beta=beta, loss_type=[loss_type],
                           per_device_train_batch_size=8, report_to="none", use_cpu=True,
                           bf16=False),  # TRL would run the reference under bf16 autocast
        train_dataset=Dataset.from_list(records), processing_class=tok)
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        theirs = float(trainer.compute_loss(trainer.model, batch))

    tokens, mask, completion = (batch[k].numpy().astype(np.int32) for k in
                                ("input_ids", "attention_mask", "completion_mask"))
    mesh = make_test_mesh((1, 1, 1))
    policy = hf.load_model(sft_dir, mesh, kind="causal_lm")
    module = policy.module

    def logps(params):
        with sharding.mesh_context(mesh):
            out, counts = jax.jit(lambda p, t, m, r: sequence_logps(module, p, t, m, r))(params, tokens, mask, completion)
        b = tokens.shape[0] // 2  # TRL's batch: chosen rows, then rejected rows
        return Pair(out[:b], out[b:]), Pair(counts[:b], counts[b:])

    (ours_policy, counts), (ours_ref, _) = logps(policy.params), logps(ref_params)
    ours, _ = dpo_loss(ours_policy, ours_ref, counts, loss_type=loss_type, beta=beta)
    assert abs(theirs - math.log(2)) > 1e-2  # the two models differ: not the trivial step-0 value
    assert float(ours) == pytest.approx(theirs, rel=1e-4)
