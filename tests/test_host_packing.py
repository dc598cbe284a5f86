"""SFT and reward-model steps on packed rows (`packing.rows`): the host packing's layout, the
packed loss and gradient (SFT) and scores (reward model) against transformers' GPT-2 on the padded
examples, the trainers' packed and fallback steps, and bad settings refused before anything compiles."""

import jax
import numpy as np
import pytest
import torch
import test_reward_model as rm
from test_sft import make, records, tiny_config

from ppo_jax.config import ConfigError
from ppo_jax.data.host_packing import pack_pairs, pack_sft
from ppo_jax.data.tokenization import PreferenceBatch, SFTBatch
from ppo_jax.supervised.reward_model import packed_pair_scores
from ppo_jax.supervised.sft import sft_loss


def padded_batch(lengths, length=10, prompt=3, seed=0):
    """A left-padded SFTBatch [B, length]: row b holds lengths[b] real tokens, the last
    lengths[b] - prompt of them in the loss."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    tokens = np.zeros((b, length), np.int32)
    mask = np.zeros((b, length), np.int32)
    loss_mask = np.zeros((b, length), np.int32)
    for i, n in enumerate(lengths):
        tokens[i, length - n:] = rng.integers(1, 40, n)
        mask[i, length - n:] = 1
        loss_mask[i, length - n + prompt:] = 1
    return SFTBatch(tokens=tokens, mask=mask, loss_mask=loss_mask)


def test_packing_keeps_every_example_whole_in_order_with_its_own_positions():
    lengths = [10, 4, 7, 3, 9, 5, 6, 6]
    batch = padded_batch(lengths)
    packed = pack_sft(batch, num_rows=3, row_length=20)
    assert packed is not None and packed.tokens.shape == (3, 20)
    for b, n in enumerate(lengths):
        row, slots = np.nonzero(packed.segment_ids == b + 1)
        assert len(set(row)) == 1 and np.array_equal(slots, np.arange(slots[0], slots[0] + n))  # one contiguous run
        np.testing.assert_array_equal(packed.tokens[row, slots], batch.tokens[b, -n:])
        np.testing.assert_array_equal(packed.positions[row, slots], np.arange(n))
        # The loss mask travels with the tokens, but an example's first slot predicts nothing of its own.
        np.testing.assert_array_equal(packed.loss_mask[row, slots][1:], batch.loss_mask[b, -n:][1:])
        assert packed.loss_mask[row[0], slots[0]] == 0
    assert packed.mask.sum() == sum(lengths) and not packed.tokens[packed.mask == 0].any()
    np.testing.assert_array_equal(packed.mask, packed.segment_ids != 0)


def test_a_batch_that_does_not_fit_is_refused_not_cut():
    batch = padded_batch([10, 10, 10, 9])  # 39 tokens: 2 rows of 20 hold them only as 10 + 10 and 10 + 9
    assert pack_sft(batch, num_rows=2, row_length=20) is not None
    assert pack_sft(padded_batch([10, 10, 10, 10, 1]), num_rows=2, row_length=20) is None
    assert pack_sft(padded_batch([8, 8, 8]), num_rows=1, row_length=20) is None  # 24 tokens > 20 slots


def _torch_loss_and_grads(out_dir, batch):
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(out_dir).eval()
    ids = torch.tensor(batch.tokens, dtype=torch.long)
    mask = torch.tensor(batch.mask, dtype=torch.long)
    positions = (mask.cumsum(-1) - mask).clamp(min=0)
    labels = torch.where(torch.tensor(batch.loss_mask) == 1, ids, torch.full_like(ids, -100))
    loss = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
    loss.backward()
    return loss.item(), {name: p.grad.numpy() for name, p in model.named_parameters()}


def test_packed_loss_and_gradient_match_transformers_on_the_padded_examples(tmp_path):
    trainer = make(tiny_config(**{"train.export": False}), tmp_path / "run")
    trainer.train_step()  # weights away from their init
    out_dir = trainer.export(str(tmp_path / "hf"))
    batch = trainer.prompt_tokenizer.sft(records(12, seed=3), length=trainer.length)
    packed = pack_sft(batch, num_rows=4, row_length=2 * trainer.length)
    assert packed is not None and packed.tokens.size < batch.tokens.size

    (loss, metrics), grads = jax.value_and_grad(lambda p: sft_loss(trainer.module, p, packed), has_aux=True)(
        trainer.params)
    reference, torch_grads = _torch_loss_and_grads(out_dir, batch)
    assert float(loss) == pytest.approx(reference, rel=1e-5)
    assert float(metrics["train/tokens"]) == batch.loss_mask.sum()
    # The token embedding's gradient gathers every position's: a token attending across examples, a wrong
    # position or a target taken from the next example would move it.
    wte = np.asarray(grads["transformer"]["embed"]["embedding"])
    np.testing.assert_allclose(wte, torch_grads["transformer.wte.weight"], rtol=2e-4, atol=2e-6)
    wpe = np.asarray(grads["transformer"]["pos_embed"]["embedding"])
    np.testing.assert_allclose(wpe, torch_grads["transformer.wpe.weight"], rtol=2e-4, atol=2e-6)


def test_trainer_steps_run_packed_and_fall_back_to_padded_rows(tmp_path):
    length = 8 + 6  # tiny_config's prompt + response lengths
    packed_run = make(tiny_config(**{"packing.rows": 6}), tmp_path / "packed")
    padded_run = make(tiny_config(), tmp_path / "padded")
    for _ in range(3):
        packed, padded = packed_run.train_step(), padded_run.train_step()
        # 16 examples of 7-13 tokens fit 6 rows of 28 slots: 168 slots instead of 16 x 14 = 224.
        assert packed["train/token_slots"] == 6 * 2 * length and padded["train/token_slots"] == 16 * length
        assert packed["train/tokens"] == padded["train/tokens"]
        assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-5)
        assert packed["train/grad_norm"] == pytest.approx(padded["train/grad_norm"], rel=1e-4)
    tight = make(tiny_config(**{"packing.rows": 1}), tmp_path / "tight")  # never fits: padded steps
    assert tight.train_step()["train/token_slots"] == 16 * length


@pytest.mark.parametrize("overrides, message", [
    ({"packing.rows": -1}, "packing.rows must be >= 0"),
    ({"packing.rows": 4, "packing.length": 10}, "packing.length=10 is shorter than one example"),
])
def test_bad_packing_settings_fail_before_compiling(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make(tiny_config(**overrides), tmp_path, mesh_shape=(2, 1, 1))
    assert not (tmp_path / "checkpoints").exists()



def test_packed_rows_are_split_like_a_padded_batch(tmp_path):
    # 5 rows cannot be split over 2 devices of the batch axis: 6 are packed (and the step runs on them).
    trainer = make(tiny_config(**{"packing.rows": 5}), tmp_path, mesh_shape=(2, 1, 1))
    assert trainer.packed_shape == (6, 2 * (8 + 6))
    assert trainer.train_step()["train/token_slots"] == 6 * 2 * (8 + 6)


def test_pair_packing_reads_each_score_at_its_sequences_last_token():
    chosen, rejected = padded_batch([9, 3, 6]), padded_batch([4, 10, 5], seed=1)
    batch = PreferenceBatch(chosen.tokens, chosen.mask, chosen.loss_mask, rejected.tokens, rejected.mask,
                            rejected.loss_mask)
    packed = pack_pairs(batch, num_rows=3, row_length=14)
    assert packed is not None
    flat_tokens, flat_segments = packed.tokens.reshape(-1), packed.segment_ids.reshape(-1)
    # Left-padded rows end in their last real token: the packed slot it moved to is last_slots.
    np.testing.assert_array_equal(flat_tokens[packed.last_slots],
                                  np.concatenate([chosen.tokens[:, -1], rejected.tokens[:, -1]]))
    np.testing.assert_array_equal(flat_segments[packed.last_slots], np.arange(1, 7))
    for seq, slot in enumerate(packed.last_slots):  # the sequence ends there: the next slot is another's
        assert slot + 1 == flat_segments.size or flat_segments[slot + 1] != seq + 1
    assert pack_pairs(batch, num_rows=2, row_length=14) is None  # 37 tokens > 28 slots


def test_packed_reward_scores_match_transformers_on_the_padded_pairs(tmp_path):
    from transformers import GPT2ForSequenceClassification

    trainer = rm.make(rm.tiny_config(**{"train.export": False}), tmp_path / "run")
    trainer.train_step()
    out_dir = trainer.export(str(tmp_path / "hf"))
    batch = trainer.prompt_tokenizer.preferences(rm.pairs(12, seed=5), length=trainer.length)
    packed = pack_pairs(batch, num_rows=10, row_length=2 * trainer.length)
    assert packed is not None and packed.tokens.size < 2 * batch.chosen_tokens.size
    chosen, rejected = packed_pair_scores(trainer.module, trainer.params, packed)

    model = GPT2ForSequenceClassification.from_pretrained(out_dir).eval()
    ids = torch.tensor(np.concatenate([batch.chosen_tokens, batch.rejected_tokens]), dtype=torch.long)
    mask = torch.tensor(np.concatenate([batch.chosen_mask, batch.rejected_mask]), dtype=torch.long)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - mask)).logits[:, 0]
    np.testing.assert_allclose(np.concatenate([chosen, rejected]), reference.numpy(), atol=2e-4)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (2, 1, 1)])
def test_reward_model_steps_run_packed_like_padded(tmp_path, mesh_shape):
    length = 6 + 8  # tiny_supervised_config's prompt + response lengths
    packed_run = rm.make(rm.tiny_config(**{"packing.rows": 14}), tmp_path / "packed", mesh_shape)
    padded_run = rm.make(rm.tiny_config(), tmp_path / "padded", mesh_shape)
    for _ in range(2):
        packed, padded = packed_run.train_step(), padded_run.train_step()
        # 16 pairs: 32 sequences of 9-11 tokens in 14 rows of 28 slots (392) instead of 32 x 14 (448).
        assert packed["train/token_slots"] == 14 * 2 * length and padded["train/token_slots"] == 32 * length
        assert packed["train/loss"] == pytest.approx(padded["train/loss"], rel=1e-5)
        assert packed["train/accuracy"] == padded["train/accuracy"]
        assert packed["train/grad_norm"] == pytest.approx(padded["train/grad_norm"], rel=1e-4)


def test_a_resumed_packed_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
    config = tiny_config(**{"train.steps": 6, "train.export": False, "packing.rows": 6})
    uninterrupted = make(config, tmp_path)
    for step in range(1, 7):
        assert uninterrupted.train_step()["train/token_slots"] == 6 * 2 * (8 + 6)  # every step packed
        if step == 3:
            uninterrupted.save(3)  # the checkpoint an interrupted run would have left
    uninterrupted.close()
    resumed = make(config, tmp_path)  # the same workdir: step 3 and the data position
    assert resumed.step == 3
    resumed.train()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 jax.device_get(resumed.params), jax.device_get(uninterrupted.params))
