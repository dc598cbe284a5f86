"""Tokenisation: word tokenizer ids, chat templates (exact ids), truncation, buckets, SFT / preference layout.

Expected ids are written out by hand from the vocabulary order build_word_tokenizer documents:
pad 0, bos 1, eos 2, unk 3, then extra special tokens, then the words in order.
"""

import numpy as np
import pytest

from ppo_jax import data

WORDS = ["hello", "world", "how", "are", "you", "fine", "thanks", "bye"]
# ids:    7        8        9      10     11     12      13        14   (after 3 extra specials)
HELLO, WORLD, HOW, ARE, YOU, FINE, THANKS, BYE = range(7, 15)
PAD, BOS, EOS, UNK, SYSTEM, USER, ASSISTANT = range(7)

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return data.build_word_tokenizer(
        WORDS, extra_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"], add_bos=True)


def reference_left_pad(rows, length, pad):
    """Plain loop: right-align each row in a row of `length` pads."""
    tokens = [[pad] * length for _ in rows]
    mask = [[0] * length for _ in rows]
    for i, row in enumerate(rows):
        for j, t in enumerate(row):
            tokens[i][length - len(row) + j] = t
            mask[i][length - len(row) + j] = 1
    return np.array(tokens), np.array(mask)


def test_word_tokenizer_ids_and_round_trip(tokenizer, tmp_path):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
            tokenizer.unk_token_id) == (PAD, BOS, EOS, UNK)
    assert len(tokenizer) == 15
    assert tokenizer("hello world zebra")["input_ids"] == [BOS, HELLO, WORLD, UNK]
    assert tokenizer("hello world", add_special_tokens=False)["input_ids"] == [HELLO, WORLD]
    assert tokenizer.decode([BOS, HOW, ARE, YOU, EOS], skip_special_tokens=True) == "how are you"
    tokenizer.save_pretrained(str(tmp_path))
    from transformers import AutoTokenizer
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded("<|user|> hello")["input_ids"] == [BOS, USER, HELLO]
    with pytest.raises(ValueError, match="pad must differ from eos"):
        data.build_word_tokenizer(WORDS, pad_token="<eos>")
    with pytest.raises(ValueError, match="without whitespace"):
        data.build_word_tokenizer(["two words"])


def test_chat_template_exact_ids(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=16, chat_template=TEMPLATE)
    # One BOS from the template; the tokenizer's own BOS must not be added a second time.
    assert tok.encode_prompt("hello how are you") == [BOS, USER, HELLO, HOW, ARE, YOU, ASSISTANT]
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"},
                    {"role": "user", "content": "bye"}]
    assert tok.encode_prompt(conversation) == [BOS, USER, HELLO, ASSISTANT, FINE, USER, BYE, ASSISTANT]
    with_system = data.PromptTokenizer(tokenizer, 16, chat_template=TEMPLATE, system_prompt="thanks")
    batch = with_system(["hello", "how are you"])
    np.testing.assert_array_equal(batch.tokens, [
        [PAD] * 10 + [BOS, SYSTEM, THANKS, USER, HELLO, ASSISTANT],
        [PAD] * 8 + [BOS, SYSTEM, THANKS, USER, HOW, ARE, YOU, ASSISTANT]])
    np.testing.assert_array_equal(batch.mask, [[0] * 10 + [1] * 6, [0] * 8 + [1] * 8])


def test_tokenizer_own_chat_template_and_plain_text(tokenizer):
    templated = data.build_word_tokenizer(WORDS, extra_special_tokens=["<|system|>", "<|user|>",
                                                                       "<|assistant|>"],
                                          chat_template=TEMPLATE)
    tok = data.PromptTokenizer(templated, 8, chat_template=True)
    assert tok.encode_prompt("bye") == [BOS, USER, BYE, ASSISTANT]
    plain = data.PromptTokenizer(tokenizer, 8)
    assert plain.encode_prompt("bye") == [BOS, BYE]
    assert data.PromptTokenizer(tokenizer, 8, add_special_tokens=False).encode_prompt("bye") == [BYE]
    with pytest.raises(ValueError, match="no chat template is configured"):
        plain.encode_prompt([{"role": "user", "content": "bye"}])
    with pytest.raises(ValueError, match="has no chat template"):
        data.PromptTokenizer(tokenizer, 8, chat_template=True)
    with pytest.raises(ValueError, match="system_prompt needs a chat template"):
        data.PromptTokenizer(tokenizer, 8, system_prompt="hi")


def test_prompt_batch_matches_reference_left_pad(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=6)
    prompts = ["hello", "how are you", "fine thanks bye hello"]
    batch = tok(prompts)
    rows = [tokenizer(p)["input_ids"] for p in prompts]
    ref_tokens, ref_mask = reference_left_pad(rows, 6, PAD)
    np.testing.assert_array_equal(batch.tokens, ref_tokens)
    np.testing.assert_array_equal(batch.mask, ref_mask)
    assert batch.tokens.dtype == np.int32 and batch.mask.dtype == np.int32
    # Right-aligned: the last column is real for every row; pads are never EOS.
    assert batch.mask[:, -1].all() and not (batch.tokens[batch.mask == 0] == EOS).any()


def test_buckets_bound_the_shapes(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=12, prompt_buckets=(4, 8))
    assert tok.prompt_buckets == (4, 8, 12)
    rng = np.random.default_rng(0)
    shapes = set()
    for longest_words in [2, 6, 10, 20] * 10:  # some batches in each bucket, some truncated
        n_rows = int(rng.integers(1, 5))
        prompts = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, longest_words + 1))))
                   for _ in range(n_rows)]
        batch = tok(prompts)
        longest = max(int(m.sum()) for m in batch.mask)
        length = batch.tokens.shape[1]
        assert length in (4, 8, 12) and longest <= length
        assert length == min(b for b in (4, 8, 12) if b >= longest)
        shapes.add(length)
    assert shapes == {4, 8, 12}
    assert data.PromptTokenizer(tokenizer, 10)(["hello"]).tokens.shape == (1, 10)
    with pytest.raises(ValueError, match="exceeds the maximum length"):
        data.PromptTokenizer(tokenizer, 8, prompt_buckets=(4, 16))
    # An explicit length (e.g. agreed across processes) overrides the bucket.
    assert tok(["hello"], length=12).tokens.shape == (1, 12)


def test_truncation_left_keeps_the_end_and_counts(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=4, truncation="left")
    batch = tok(["hello world how are you", "bye", "how are you"])
    np.testing.assert_array_equal(batch.tokens, [[WORLD, HOW, ARE, YOU], [PAD, PAD, BOS, BYE],
                                                 [BOS, HOW, ARE, YOU]])
    assert tok.num_truncated_prompts == 1 and tok.num_prompts == 3
    metrics = tok.metrics()
    assert metrics["data/num_truncated_prompts"] == 1.0
    assert metrics["data/truncated_prompt_frac"] == pytest.approx(1 / 3)


def test_truncation_error_names_the_example(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=4, truncation="error")
    assert tok(["how are you"]).tokens.shape == (1, 4)  # exactly at the limit is fine
    with pytest.raises(ValueError, match=r"example prompts.jsonl\[7\].*6 tokens.*max_prompt_length=4"):
        tok.prompts(["bye", "hello world how are you"], labels=["prompts.jsonl[3]", "prompts.jsonl[7]"])
    with pytest.raises(ValueError, match="truncation must be one of"):
        data.PromptTokenizer(tokenizer, 4, truncation="right")


def test_pad_token_checks():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"<eos>": 0, "<unk>": 1, "a": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    no_pad = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    with pytest.raises(ValueError, match="no pad token; set one"):
        data.PromptTokenizer(no_pad, 8)
    no_pad.pad_token = "<eos>"
    with pytest.raises(ValueError, match="pad token equals its EOS"):
        data.PromptTokenizer(no_pad, 8)
    with pytest.raises(ValueError, match="has no tokens"):
        data.PromptTokenizer(data.build_word_tokenizer(["a"]), 8)([""])


def test_sft_layout_loss_mask_and_eos(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=4, max_response_length=3,
                               sequence_buckets=(5,))
    batch = tok.sft([{"prompt": "hello", "response": "fine"},
                     {"prompt": "how are you", "response": "fine thanks"}])
    assert tok.sequence_buckets == (5, 7)
    np.testing.assert_array_equal(batch.tokens, [[PAD, PAD, PAD, BOS, HELLO, FINE, EOS],
                                                 [BOS, HOW, ARE, YOU, FINE, THANKS, EOS]])
    np.testing.assert_array_equal(batch.mask, [[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 1, 1, 1]])
    short = tok.sft([{"prompt": "bye", "response": "thanks"}])
    np.testing.assert_array_equal(short.tokens, [[PAD, BOS, BYE, THANKS, EOS]])  # bucket 5


def test_over_long_response_is_cut_without_eos_or_rejected(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=2, max_response_length=3)
    batch = tok.sft([{"prompt": "bye", "response": "how are you fine"}])
    np.testing.assert_array_equal(batch.tokens, [[BOS, BYE, HOW, ARE, YOU]])
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 1, 1, 1]])
    assert tok.num_truncated_responses == 1 and tok.metrics()["data/truncated_response_frac"] == 1.0
    strict = data.PromptTokenizer(tokenizer, 2, truncation="error", max_response_length=3)
    with pytest.raises(ValueError, match="response 'how are you' has 3 tokens \\+ EOS"):
        strict.sft([{"prompt": "bye", "response": "how are you"}])
    with pytest.raises(ValueError, match="need max_response_length"):
        data.PromptTokenizer(tokenizer, 2).sft([{"prompt": "bye", "response": "fine"}])
    with pytest.raises(KeyError, match="batch row 0: record has no 'response' field"):
        tok.sft([{"prompt": "bye", "answer": "fine"}])


def test_preferences_share_one_right_aligned_length(tokenizer):
    tok = data.PromptTokenizer(tokenizer, max_prompt_length=8, max_response_length=4,
                               chat_template=TEMPLATE)
    batch = tok.preferences([
        {"prompt": "how are you", "chosen": "fine thanks", "rejected": "bye"},
        {"prompt": "hello", "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": "fine"}])
    prompt0 = [BOS, USER, HOW, ARE, YOU, ASSISTANT]
    prompt1 = [BOS, USER, HELLO, ASSISTANT]
    rows = {"chosen": [prompt0 + [FINE, THANKS, EOS], prompt1 + [HELLO, EOS]],
            "rejected": [prompt0 + [BYE, EOS], prompt1 + [FINE, EOS]]}
    length = batch.chosen_tokens.shape[1]
    assert length == 12 and batch.rejected_tokens.shape == (2, 12)  # one bucket: 8 + 4
    for side in ("chosen", "rejected"):
        ref_tokens, ref_mask = reference_left_pad(rows[side], length, PAD)
        np.testing.assert_array_equal(getattr(batch, f"{side}_tokens"), ref_tokens)
        np.testing.assert_array_equal(getattr(batch, f"{side}_mask"), ref_mask)
        response = getattr(batch, f"{side}_response_mask")
        np.testing.assert_array_equal(response.sum(1), [len(r) - len(p) for r, p in
                                                        zip(rows[side], [prompt0, prompt1])])
        assert (response[:, -1] == 1).all() and (getattr(batch, f"{side}_tokens")[:, -1] == EOS).all()
    assert tok.num_prompts == 2  # each prompt counted once although it is in two sequences
