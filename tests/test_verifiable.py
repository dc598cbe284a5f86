"""The verifiable-reward task (ppo_jax/verifiable): the exact checker, disjoint train/eval prompts,
imperfect demonstrations at the configured rate, and settings refused before anything trains. (The
pipeline runs end to end in tests/test_sweep.py, as a sweep of two estimators.)"""

import numpy as np
import pytest

from ppo_jax import reward_functions
from ppo_jax.config import ConfigError
from ppo_jax.verifiable.settings import VerifiableSettings, get_config
from ppo_jax.verifiable.task import SortTask, answer, is_correct, tokenizer


def test_the_checker_wants_the_words_in_increasing_value():
    assert answer("sort : seven two eleven") == "two seven eleven"  # not alphabetical: eleven seven two
    assert is_correct("sort : seven two eleven", " two  seven eleven ")
    for wrong in ("eleven seven two", "two seven", "two seven eleven eleven", "two eleven seven", ""):
        assert not is_correct("sort : seven two eleven", wrong)
    reward = reward_functions.resolve("sort_exact")
    assert reward(["sort : one zero", "sort : one zero"], ["zero one", "one zero"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="not a sort prompt"):
        answer("sort : seven apples")


def test_prompts_are_reproducible_and_eval_word_sets_are_never_trained_on():
    task = SortTask()
    train, held_out = task.prompts(2000, "train", seed=0), task.prompts(300, "eval", seed=0)
    assert train[:50] == task.prompts(50, "train", seed=0) and train[:50] != task.prompts(50, "train", seed=1)
    word_sets = lambda prompts: {frozenset(p.split()[2:]) for p in prompts}  # noqa: E731
    assert not word_sets(train) & word_sets(held_out)
    lengths = [len(p.split()) - 2 for p in train]
    assert min(lengths) == task.min_words and max(lengths) == task.max_words
    vocab = tokenizer().get_vocab()
    assert all(word in vocab for p in train[:100] for word in p.split())


def test_demonstrations_are_wrong_at_the_configured_rate():
    corpus = SortTask(demo_error_rate=0.3).sft_corpus(4000, seed=0)
    wrong = np.mean([not is_correct(r["prompt"], r["response"]) for r in corpus])
    assert abs(wrong - 0.3) < 0.03
    for r in corpus[:200]:  # a wrong one is the answer with two neighbours swapped: the same words
        assert sorted(r["response"].split()) == sorted(answer(r["prompt"]).split())
    assert all(is_correct(r["prompt"], r["response"]) for r in SortTask(demo_error_rate=0.0).sft_corpus(200))


@pytest.mark.parametrize("field, value, message", [
    ("task.max_words", 30, "need 2 <= min_words \\(3\\) <= max_words \\(30\\) <= num_values \\(20\\)"),
    ("eval.num_prompts", 20, "eval.num_prompts=20 must be a positive multiple of rl.rollout.batch_size=16"),
    ("sft.data.max_prompt_length", 4, "sft.data.max_prompt_length=4 is shorter than the task's prompts"),
    ("rl.ppo.advantage_estimator", "ppo", "advantage_estimator"),
])
def test_bad_settings_are_refused_before_anything_trains(field, value, message):
    config = get_config()
    section, name = field.rsplit(".", 1)
    node = config
    for part in section.split("."):
        node = node[part]
    node[name] = value
    with pytest.raises(ConfigError, match=message):
        VerifiableSettings.from_config(config)
    VerifiableSettings.from_config(get_config())  # the defaults pass


def test_a_rerun_starts_over_and_a_foreign_directory_is_refused(tmp_path):
    """A finished run's stages are cleared, not resumed: its RL checkpoint would otherwise be this
    run's starting policy, and its "before" accuracy the trained policy's."""
    from ppo_jax.verifiable.pipeline import MARKER, OUTPUTS, prepare_workdir

    def prepare():
        prepare_workdir(str(tmp_path), marker=MARKER, outputs=OUTPUTS, made_by="the verifiable-reward pipeline")

    (tmp_path / "mine.txt").write_text("a user's file")
    with pytest.raises(FileExistsError, match="not empty and was not made by the verifiable-reward pipeline"):
        prepare()
    (tmp_path / "mine.txt").unlink()
    prepare()
    (tmp_path / "rl" / "checkpoints").mkdir(parents=True)
    (tmp_path / "summary.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("kept")
    prepare()
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "notes.txt"]
