"""Bad prompt input fails before anything is written (issue 16 item 8): a missing prompt field names
data.field, invalid UTF-8 names its line, a BOM is accepted, empty prompts and (with
data.truncation=error) over-long prompts are found when the prompt stream is built, not at the
iteration that draws them. Mostly at the PromptStream / sources level (no model, no compile)."""

import inspect

import pytest
from conftest import make_test_mesh
from tiny_configs import tiny_config

from ppo_jax import data
from ppo_jax.config import ConfigError
from ppo_jax.data import toy
from ppo_jax.data.prompt_stream import PromptDataSettings, PromptStream
from ppo_jax.rl import settings as rl_settings
from ppo_jax.rl.trainer import PPOTrainer
from ppo_jax.supervised.sft import SFTTrainer

BOM = b"\xef\xbb\xbf"


def write(path, content: bytes | str) -> str:
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return str(path)


def stream(prompts_path=None, prompts=None, **settings):
    """A PromptStream over a file (data.prompts) or a list given in code, on the toy tokenizer."""
    d = PromptDataSettings(**({"prompts": prompts_path} if prompts_path else {}), prompt_length=8,
                           **settings)
    return PromptStream(d, toy.tokenizer(32), batch_size=4, seed=0, prompts=prompts)


def expect_trainer_error(config, tmp_path, match):
    """The constructor raises (a one-line ValueError, as the CLI prints it) and writes nothing."""
    workdir = tmp_path / "workdir"
    with pytest.raises(ValueError, match=match):
        PPOTrainer(config, str(workdir), mesh=make_test_mesh((1, 1, 1)))
    assert not workdir.exists()


# ---------------------------------------------------------------------------------------------
# (a) a record without the prompt field: the config route names data.field, the API route fields=.


def test_missing_prompt_field_names_data_field_and_line(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "w1 w2"}\n{"question": "w3"}\n')
    with pytest.raises(ConfigError) as e:
        stream(path)
    message = str(e.value)
    assert message.startswith(f"{path}:2: ")  # one line, no KeyError quotes around it
    assert "'prompt'" in message and "['question']" in message
    assert "--config.data.field=<name in your data>" in message
    assert "fields=" not in message  # not the Python API's hint


def test_missing_renamed_field_names_the_configured_field(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"question": "w3"}\n')
    with pytest.raises(ConfigError, match=rf"{path}:1: .*data.field='text'.*--config.data.field="):
        stream(path, field="text")
    assert stream(path, field="question").next_batch()[0].shape == (4, 8)


def test_missing_field_from_the_python_api_keeps_its_hint_and_reads_as_one_line(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"text": "a"}\n')
    with pytest.raises(ValueError) as e:
        data.from_jsonl(path, fields={"prompt": "question"})
    assert isinstance(e.value, KeyError)  # still a KeyError for callers that catch one
    message = str(e.value)
    assert message.startswith(f"{path}:1: missing field 'prompt' (stored as 'question')")
    assert "fields={'prompt': '<name in your data>'}" in message


def test_missing_prompt_field_end_to_end(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"question": "w3"}\n')
    expect_trainer_error(tiny_config(**{"data.prompts": path}), tmp_path,
                         r"p.jsonl:1: .*--config.data.field=")


# ---------------------------------------------------------------------------------------------
# (b) invalid UTF-8 names the file and the line; (c) a byte-order mark is accepted.


@pytest.mark.parametrize("name, content", [
    ("p.jsonl", b'{"prompt": "w1"}\n\n{"prompt": "caf\xe9"}\n'),
    ("p.txt", b"w1 w2\n\ncaf\xe9 w3\n"),
])
def test_invalid_utf8_names_file_and_line(tmp_path, name, content):
    path = write(tmp_path / name, content)
    read = data.from_jsonl if name.endswith(".jsonl") else data.from_text
    with pytest.raises(ValueError, match=rf"{path}:3: not valid UTF-8 \(byte 0xe9"):
        read(path)
    expect_trainer_error(tiny_config(**{"data.prompts": path}), tmp_path, rf"{name}:3: not valid UTF-8")


def test_invalid_utf8_after_a_bom_counts_lines_from_one(tmp_path):
    path = write(tmp_path / "p.txt", BOM + b"\xff\n")
    with pytest.raises(ValueError, match=rf"{path}:1: not valid UTF-8 \(byte 0xff at byte 1"):
        data.from_text(path)


def test_byte_order_mark_is_accepted(tmp_path):
    jsonl = write(tmp_path / "p.jsonl", BOM + b'{"prompt": "w1 w2"}\n{"prompt": "w3"}\n')
    assert data.from_jsonl(jsonl)[0] == {"prompt": "w1 w2"}
    text = write(tmp_path / "p.txt", BOM + b"w1 w2\r\nw3\r\n")
    assert [data.from_text(text)[i] for i in range(2)] == [{"prompt": "w1 w2"}, {"prompt": "w3"}]
    assert stream(jsonl).next_batch()[0].shape == (4, 8)


# ---------------------------------------------------------------------------------------------
# (d) empty prompts are refused when the stream is built, naming the record.


@pytest.mark.parametrize("line, reason", [
    ('{"prompt": ""}', "prompt is empty"),
    ('{"prompt": "  \\t"}', r"prompt is empty \(only whitespace\)"),
    ('{"prompt": []}', r"prompt is empty \(no chat messages\)"),
])
def test_empty_prompt_in_a_file_names_the_line(tmp_path, line, reason):
    path = write(tmp_path / "p.jsonl", '{"prompt": "w1 w2"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"{path}:2: {reason}"):
        stream(path)


def test_empty_prompt_given_in_code_names_its_index():
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt is empty"):
        stream(prompts=["w1 w2", "", "w3"])


def test_blank_text_lines_are_still_skipped(tmp_path):
    # A .txt file has one prompt per line and skips blank ones (documented), whitespace-only too.
    path = write(tmp_path / "p.txt", "w1 w2\n   \n\nw3\n")
    assert len(data.from_text(path)) == 2
    assert stream(path).next_batch()[0].shape == (4, 8)


def test_empty_prompt_end_to_end(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "w1"}\n{"prompt": ""}\n')
    expect_trainer_error(tiny_config(**{"data.prompts": path}), tmp_path, r"p.jsonl:2: prompt is empty")


# ---------------------------------------------------------------------------------------------
# (e) data.truncation=error: every prompt is measured when the stream is built.


def test_overlong_prompt_is_found_up_front_with_its_line_count_and_limit(tmp_path):
    lines = ["w1 w2"] * 40 + [" ".join(["w3"] * 11), " ".join(["w4"] * 20)]
    path = write(tmp_path / "p.txt", "\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        stream(path, truncation="error")
    message = str(e.value)
    assert message.startswith(f"{path}:41: prompt 'w3 w3")  # the first offender, by its line
    assert "has 11 tokens, more than max_prompt_length=8" in message
    assert "--config.data.prompt_length" in message and "--config.data.truncation=left" in message
    # Left truncation keeps accepting (and counting) them.
    assert stream(path, truncation="left").next_batch()[0].shape == (4, 8)


def test_overlong_prompt_given_in_code_names_its_index():
    prompts = ["w1 w2"] * 9 + [" ".join(["w3"] * 9)]
    with pytest.raises(ValueError, match=r"prompts\[9\]: prompt .* has 9 tokens, more than "
                                         r"max_prompt_length=8"):
        stream(prompts=prompts, truncation="error")


def test_per_batch_check_is_unchanged():
    tokenizer = data.PromptTokenizer(toy.tokenizer(32), max_prompt_length=4, truncation="error")
    with pytest.raises(ValueError, match="example x: prompt .* has 5 tokens"):
        tokenizer.prompts(["w1 w1 w1 w1 w1"], labels=["x"])


def test_overlong_prompt_fails_in_the_trainer_constructor(tmp_path):
    path = write(tmp_path / "p.txt", "w1 w2\n" * 50 + " ".join(["w1"] * 20) + "\n")
    config = tiny_config(**{"data.prompts": path, "data.truncation": "error"})
    expect_trainer_error(config, tmp_path, r"p.txt:51: prompt .* has 20 tokens, more than max_prompt_length=8")


# ---------------------------------------------------------------------------------------------
# (f) policy.path / reward.path read Hugging Face directories only; the comments say so.


@pytest.mark.parametrize("section", [rl_settings.PolicySettings, rl_settings.RewardSettings])
def test_path_comments_name_hugging_face_directories_only(section):
    line = next(line for line in inspect.getsource(section).splitlines()
                if line.strip().startswith("path: str"))
    comment = line.split("#", 1)[1]
    assert "Hugging Face" in comment and "not a ppo_jax checkpoint" in comment


# ---------------------------------------------------------------------------------------------
# (f) prompts the tokenizer reads as nothing (issue 33): an error naming the record, for every
# trainer and data source, before anything compiles; a tokenizer losing words: one warning line.


def test_a_prompt_of_unknown_words_names_the_line(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"prompt": "w1 w2"}\n{"prompt": "hello there"}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: prompt 'hello there' tokenizes to only special tokens "
                                         r"\['<unk>', '<unk>'\]: the tokenizer \(.*\) does not know its words"):
        stream(path)


def test_a_chat_prompt_whose_content_is_lost_is_refused_although_the_template_gives_tokens():
    """The template's markers are tokens, so the encoded prompt is not empty: the content is checked."""
    template = "{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> {% endfor %}<|im_start|>"
    tok = data.build_word_tokenizer(toy.words(32), extra_special_tokens=["<|im_start|>", "<|im_end|>"],
                                    chat_template=template)
    d = PromptDataSettings(prompt_length=8, chat_template=True)
    prompts = [[{"role": "user", "content": "w1"}], [{"role": "user", "content": "zz"}]]
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt .*tokenizes to only special tokens \['<unk>'\]"):
        PromptStream(d, tok, batch_size=2, seed=0, prompts=prompts)


def test_a_tokenizer_that_loses_some_words_gets_one_warning_line(capsys):
    stream(prompts=["w1 hello w2", "w3 w4"])
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and "loses words of prompt 'w1 hello w2'" in out and "'hello'" in out
    stream(prompts=["w1 w2", "w3 w4"])
    assert "warning:" not in capsys.readouterr().out


def test_the_content_check_runs_in_every_trainer_before_anything_compiles(tmp_path):
    from test_dpo import tiny_config as dpo_config
    from test_sft import records, tokenizer
    from test_sft import tiny_config as sft_config

    from ppo_jax.supervised.dpo import DPOTrainer
    from ppo_jax.supervised.reward_model import RewardModelTrainer
    from ppo_jax.supervised.settings import reward_model_config

    sft_records = records(4) + [{"prompt": "bonjour", "response": "w1"}]
    with pytest.raises(ValueError, match=r"sft train data\[4\]: prompt 'bonjour' tokenizes to only special"):
        SFTTrainer(sft_config(), str(tmp_path / "sft"), tokenizer=tokenizer(), train_records=sft_records)
    pairs = [{"prompt": "w1 w2", "chosen": "w3", "rejected": "w4"}, {"prompt": "salut", "chosen": "w3", "rejected": "w4"}]
    with pytest.raises(ValueError, match=r"dpo eval data\[1\]: prompt 'salut'"):
        DPOTrainer(dpo_config(), str(tmp_path / "dpo"), tokenizer=tokenizer(), train_records=pairs[:1],
                   eval_records=pairs)
    with pytest.raises(ValueError, match=r"reward_model train data\[1\]: prompt 'salut'"):
        RewardModelTrainer(reward_model_config(), str(tmp_path / "rm"), tokenizer=tokenizer(), train_records=pairs)
    assert not any((tmp_path / name).exists() for name in ("sft", "dpo", "rm"))
    # The PPO trainer too (its prompts go through the PromptStream above).
    path = write(tmp_path / "p.jsonl", '{"prompt": "w1"}\n{"prompt": "hola"}\n')
    expect_trainer_error(tiny_config(**{"data.prompts": path}), tmp_path, r"p.jsonl:2: prompt 'hola' tokenizes")
