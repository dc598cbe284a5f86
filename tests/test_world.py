"""The demo's synthetic world: tokenizer, prompts, corpus, the gold reward (hand-computed values and a
search for anything better than the claimed best), and Bradley-Terry preference labels."""

import math

import numpy as np
import pytest

from ppo_jax import reward_functions as reward_fns
from ppo_jax.demo import world as W

WORLD = W.World()
P = "describe the garden ."


def test_tokenizer_word_level_pad_is_not_eos():
    tok = WORLD.tokenizer
    assert len(tok) == WORLD.vocab_size >= 200  # a few hundred words
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2 and tok.pad_token_id != tok.eos_token_id
    for word in W.vocabulary():
        ids = tok(word, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and ids[0] != tok.unk_token_id, word
    # One word, one token: a budget in tokens is a budget in words.
    text = "the garden is very lovely , warm and bright ."
    assert len(tok(text)["input_ids"]) == len(text.split())


def test_prompts_splits_are_disjoint_and_name_one_topic():
    train, held_out = WORLD.all_prompts("train"), WORLD.all_prompts("eval")
    assert not set(train) & set(held_out)
    assert len(held_out) == round(0.2 * (len(train) + len(held_out)))
    for p in train + held_out:
        assert W.topic_of(p) in W.TOPICS
        assert len(p.split()) <= 10  # the demo's prompt_length
    assert WORLD.prompts(50, "train", seed=3) == WORLD.prompts(50, "train", seed=3)
    assert WORLD.prompts(50, "train", seed=3) != WORLD.prompts(50, "train", seed=4)
    with pytest.raises(ValueError, match="exactly one topic"):
        W.topic_of("tell me about the garden and the river .")


@pytest.mark.parametrize("response, stopped, expected", [
    ("the garden is lovely , warm and bright .", True, 1 + 1.5 * (1 - 1 / 8)),  # the best: 2.3125
    ("the garden is lovely , warm and bright .", False, -2.0),  # never stopped
    ("the garden is lovely .", True, 1 + 0.75),
    ("the river is lovely .", True, -0.5 + 0.75),  # another topic
    ("it is lovely .", True, 0.75),  # no topic
    ("the garden is lovely and lovely .", True, 1 + 1.125 - 0.5),  # a repeated adjective
    ("the garden is very very lovely .", True, 1 + 0.75 - 0.5),  # a repeated intensifier
    ("the garden is lovely warm bright calm sunny .", True, 1 + 1.3125 - 2 * 0.25),  # gushing
    ("the garden is dull and cold .", True, 1 - 1.2),
    ("the garden is dull but lovely .", True, 1 + 0.75 - 0.6),
    ("garden", True, 1 - 0.5),  # too short
    ("the garden is a large old and wide public place with a view .", True, 1 - 0.15 * 4),  # 14 words
])
def test_gold_reward_hand_computed(response, stopped, expected):
    assert W.gold_reward(P, response, stopped) == pytest.approx(expected, abs=1e-12)


def test_best_gold_is_attained_and_never_beaten():
    assert W.BEST_GOLD == pytest.approx(2.3125)
    assert WORLD.gold(P, WORLD.best_response(P), True) == pytest.approx(W.BEST_GOLD)
    rng = np.random.default_rng(0)
    words = W.vocabulary()
    best = -math.inf
    # Random answers, corpus answers, and hill-climbing from them: none beats the stated best.
    candidates = [WORLD.sample_response(rng, P).split() for _ in range(300)]
    candidates += [list(rng.choice(words, size=rng.integers(1, 15))) for _ in range(300)]
    for cand in candidates[:60]:
        current = list(cand)
        score = WORLD.gold(P, " ".join(current), True)
        for _ in range(150):
            trial = list(current)
            op = rng.integers(3)
            if op == 0 or not trial:
                trial.insert(int(rng.integers(len(trial) + 1)), str(rng.choice(words + ["garden"] * 20)))
            elif op == 1:
                trial.pop(int(rng.integers(len(trial))))
            else:
                trial[int(rng.integers(len(trial)))] = str(rng.choice(words))
            if len(trial) < WORLD.max_response_tokens:
                s = WORLD.gold(P, " ".join(trial), True)
                if s >= score:
                    current, score = trial, s
        best = max(best, score)
    for cand in candidates:
        best = max(best, WORLD.gold(P, " ".join(cand), True))
    assert best <= W.BEST_GOLD + 1e-12
    assert best > 2.0  # the search does find the good region


def test_corpus_is_reproducible_and_of_mixed_quality():
    a, b = WORLD.sft_corpus(2000, seed=0), WORLD.sft_corpus(2000, seed=0)
    assert a == b and a != WORLD.sft_corpus(2000, seed=1)
    gold = np.array([WORLD.gold(r["prompt"], r["response"]) for r in a])
    assert 0.2 < np.mean(gold >= 1.5) < 0.6  # plenty of good answers to learn from
    assert 0.2 < np.mean(gold <= 0.0) < 0.6  # and plenty of bad ones
    assert 0.05 < np.mean(gold == W.FLOOR) < 0.25  # rambling past the budget
    # Goodhart bait: more than three positive adjectives is rare, so a learned proxy barely sees the
    # gushing decline; intensifiers come with good answers although the gold reward ignores them.
    breakdowns = [W.gold_breakdown(r["prompt"], r["response"], True) for r in a]
    assert np.mean([b.num_positive > 3 for b in breakdowns]) < 0.1
    intense = np.array([any(w in W.INTENSIFIERS for w in r["response"].split()) for r in a])
    assert gold[intense].mean() > gold[~intense].mean() + 0.2


def test_decode_response_keeps_stray_specials_and_finds_the_stop():
    tok = WORLD.tokenizer
    ids = tok("the garden is lovely .", add_special_tokens=False)["input_ids"]
    text, stopped = WORLD.decode_response(ids + [tok.eos_token_id, 0, 0])
    assert (text, stopped) == ("the garden is lovely .", True)
    text, stopped = WORLD.decode_response(ids[:2] + [tok.pad_token_id] + ids[2:])
    assert text == "the garden <pad> is lovely ." and not stopped


def test_label_pairs_exact_and_bradley_terry_noise():
    prompts = [P] * 3
    a = ["the garden is lovely .", "it is dull .", "the garden is lovely ."]
    b = ["it is dull .", "the garden is lovely .", "the garden is lovely ."]
    exact = WORLD.label_pairs(prompts, a, b, [True] * 3, [True] * 3, rng=None, temperature=0.5)
    assert len(exact) == 2  # the tie has no right answer and is dropped
    for r in exact:
        assert r["chosen"] == "the garden is lovely ." and r["gold_chosen"] > r["gold_rejected"]
    # Noisy labels: the better answer wins with probability sigmoid(diff / T).
    n, temperature = 4000, 0.5
    diff = WORLD.gold(P, a[0], True) - WORLD.gold(P, b[0], True)
    noisy = WORLD.label_pairs([P] * n, [a[0]] * n, [b[0]] * n, [True] * n, [True] * n,
                              rng=np.random.default_rng(0), temperature=temperature)
    wins = np.mean([r["chosen"] == a[0] for r in noisy])
    expected = 1 / (1 + math.exp(-diff / temperature))
    assert abs(wins - expected) < 4 * math.sqrt(expected * (1 - expected) / n)
    with pytest.raises(ValueError, match="temperature"):
        WORLD.label_pairs(prompts, a, b, [True] * 3, [True] * 3, rng=np.random.default_rng(0), temperature=0)


def test_registered_gold_reward_function_infers_stop_from_length():
    fn = reward_fns.resolve("demo_gold")  # registered by importing the world (this module did)
    assert fn is reward_fns.resolve("ppo_jax.demo.world:gold_reward_fn")
    long = " ".join(["lovely"] * WORLD.max_response_tokens)
    scores = fn([P, P], ["the garden is lovely .", long])
    assert scores == [pytest.approx(1.75), W.FLOOR]


def test_gold_reward_resolves_by_import_path_in_a_fresh_process():
    """A config naming the gold reward by "module:function" works in a fresh process that never imported
    the world; the registry itself imports nothing (no hidden edge from the library up to the demo)."""
    import subprocess
    import sys

    code = ("from ppo_jax import reward_functions; import sys; assert 'ppo_jax.demo.world' not in sys.modules; "
            "fn = reward_functions.resolve('ppo_jax.demo.world:gold_reward_fn'); print(fn.__module__); "
            "print('ppo_jax.demo.world' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ppo_jax.demo.world", "True"]
    with pytest.raises(ValueError, match="module:function"):  # the error says how to name one
        reward_fns.resolve("no_such_reward")


def test_world_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_response_tokens"):
        W.World(max_response_tokens=8)
    with pytest.raises(ValueError, match="p_ramble"):
        W.World(p_ramble=1.5)
    with pytest.raises(ValueError, match="unknown fields"):
        W.world_from_config({"max_response_token": 16})
