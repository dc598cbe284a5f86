"""SFT trainer: the loss equals transformers' GPT-2 loss with prompt labels ignored, training learns,
one step is the same on every mesh, a resumed run equals an uninterrupted one, the export loads in
transformers, and bad configs fail before anything compiles."""

import json
import os

import jax
import numpy as np
import pytest
import torch
from conftest import make_test_mesh, tiny_supervised_config

from ppo_jax.config import ConfigError
from ppo_jax.data import build_word_tokenizer
from ppo_jax.supervised.base import summary_line
from ppo_jax.supervised.sft import SFTTrainer, sft_config, sft_loss

WORDS = [f"w{i}" for i in range(40)] + ["?", "."]


def tokenizer():
    return build_word_tokenizer(WORDS)


def records(n, seed=0):
    """A learnable task: the response repeats the prompt's last word, then says 'w0 .'."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = [f"w{i}" for i in rng.integers(1, 40, size=rng.integers(2, 6))]
        out.append({"prompt": " ".join(words) + " ?", "response": f"{words[-1]} w0 ."})
    return out


def tiny_config(**overrides):
    return tiny_supervised_config(sft_config(), **{"data.max_prompt_length": 8, "data.max_response_length": 6,
                                                   "optim.lr": 3e-3, **overrides})


def make(config, tmp_path, mesh_shape=(1, 1, 1), n=64, **kw):
    return SFTTrainer(config, str(tmp_path), tokenizer=tokenizer(), train_records=records(n),
                      mesh=make_test_mesh(mesh_shape), **kw)


def test_loss_matches_transformers_gpt2_with_prompt_labels_ignored(tmp_path):
    # Training data from a JSONL file whose fields have other names (mapped by the config).
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for r in records(32):
            f.write(json.dumps({"question": r["prompt"], "answer": r["response"]}) + "\n")
    config = tiny_config(**{"train.export": False})
    config.data.train = str(path)
    config.data.prompt_field, config.data.response_field = "question", "answer"
    trainer = SFTTrainer(config, str(tmp_path / "run"), tokenizer=tokenizer(), mesh=make_test_mesh((1, 1, 1)))
    assert np.isfinite(trainer.train_step()["train/loss"])
    out_dir = trainer.export(str(tmp_path / "hf"))
    recs = records(6, seed=3)
    batch = trainer.prompt_tokenizer.sft(recs, length=trainer.length)
    loss, metrics = sft_loss(trainer.module, trainer.params, batch)

    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(out_dir).eval()
    ids = torch.tensor(batch.tokens, dtype=torch.long)
    mask = torch.tensor(batch.mask, dtype=torch.long)
    positions = (mask.cumsum(-1) - mask).clamp(min=0)
    labels = torch.where(torch.tensor(batch.loss_mask) == 1, ids, torch.full_like(ids, -100))
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
    assert float(loss) == pytest.approx(float(reference), rel=1e-5)
    # Targets are exactly the response tokens and their EOS: 2 words + "." + EOS per example.
    assert float(metrics["train/tokens"]) == 6 * 4


def test_training_learns_the_task_and_writes_metrics_checkpoints_export(tmp_path):
    config = tiny_config(**{"train.steps": 80, "train.log_every": 20, "train.eval_every": 40})
    trainer = make(config, tmp_path, n=512, eval_records=records(64, seed=9))
    start = trainer.evaluate()
    history = trainer.train()
    assert history[-1]["eval/loss"] < 0.6 * start["eval/loss"]
    assert history[-1]["eval/accuracy"] > 0.6
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [20, 40, 60, 80]
    assert "eval/loss" in rows[1] and "train/loss" in rows[0]
    assert os.path.isdir(tmp_path / "checkpoints" / "80")
    assert os.path.isdir(tmp_path / "tensorboard")

    from transformers import AutoTokenizer, GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert model.config.vocab_size == 48 and tok.get_vocab() == tokenizer().get_vocab()
    # The command line's last line: the final metrics by name, not a Python dict.
    line = summary_line(trainer, history)
    assert line.startswith("done: 80 steps (train/") and "train/loss " in line and "eval/accuracy " in line
    assert "{" not in line and "train/tokens 64," in line
    assert line.endswith(f"; Hugging Face export in {tmp_path / 'hf'}")


def test_two_steps_are_the_same_on_every_mesh(tmp_path):
    results = []
    for shape in [(1, 1, 1), (2, 2, 2)]:
        trainer = make(tiny_config(**{"train.steps": 2, "train.export": False}), tmp_path / "x".join(map(str, shape)),
                       mesh_shape=shape)
        first, second = trainer.train_step(), trainer.train_step()
        # The second loss is computed with the updated params, so it checks the update as well.
        results.append((first["train/loss"], first["train/grad_norm"], second["train/loss"]))
        trainer.close()
    np.testing.assert_allclose(results[1], results[0], rtol=1e-5)


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    config = tiny_config(**{"train.steps": 6, "train.export": False})
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


@pytest.mark.parametrize("overrides, kwargs, message", [
    ({}, {"train_records": None}, "no training data"),
    ({"model.config": None}, {}, "tokenizer has 46 tokens but the model's vocabulary has 40"),
    ({"data.max_response_length": 30}, {}, "exceeds the model's max_position_embeddings=32; shorten them to fit, "
                                           "e.g. --config.data.max_prompt_length=6 --config.data.max_response_length=26"),
    ({"train.batch_size": 12}, {"mesh": (8, 1, 1)}, "train.batch_size=12 does not split over the 8"),
    ({"optim.schedule": "step"}, {}, "optim.schedule='step'"),
])
def test_bad_configs_fail_clearly(tmp_path, overrides, kwargs, message):
    config = tiny_config()
    for key, value in overrides.items():
        if key == "model.config":
            config.model.config.vocab_size = 40
            continue
        section, field = key.split(".")
        config[section][field] = value
    mesh = make_test_mesh(kwargs.pop("mesh", (1, 1, 1)))
    args = {"train_records": records(8), **kwargs}
    with pytest.raises(ConfigError, match=message):
        SFTTrainer(config, str(tmp_path), tokenizer=tokenizer(), mesh=mesh, **args)
