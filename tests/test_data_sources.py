"""Record sources: JSONL / text / lists with precise errors, a local TFDS round trip, local HF datasets."""

import json
import subprocess
import sys

import datasets
import numpy as np
import pytest
import tensorflow_datasets as tfds

from ppo_jax import data


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------
# JSONL, text, lists


def test_jsonl_reads_records_skips_blank_lines_and_renames_fields(tmp_path):
    path = write(tmp_path / "p.jsonl",
                 '{"question": "two plus two", "answer": "four", "id": 1}\n\n'
                 '{"question": "capital of France", "answer": "Paris", "id": 2}\n')
    everything = data.from_jsonl(path)
    assert len(everything) == 2
    assert everything[1] == {"question": "capital of France", "answer": "Paris", "id": 2}
    renamed = data.from_jsonl(path, fields={"prompt": "question", "response": "answer"})
    assert [renamed[i] for i in range(2)] == [
        {"prompt": "two plus two", "response": "four"},
        {"prompt": "capital of France", "response": "Paris"}]
    # Chat-message prompts pass validation.
    chat = write(tmp_path / "c.jsonl", json.dumps(
        {"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    assert data.from_jsonl(chat, fields=data.PROMPT_FIELDS)[0]["prompt"][0]["content"] == "hi"


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.jsonl", '{"prompt": "ok"}\n\n{"prompt": "broken",\n{"prompt": "x"}\n')
    with pytest.raises(ValueError) as e:
        data.from_jsonl(path)
    assert f"{path}:3" in str(e.value) and "malformed JSON" in str(e.value)


def test_jsonl_line_that_is_not_an_object_names_file_and_line(tmp_path):
    path = write(tmp_path / "list.jsonl", '{"prompt": "ok"}\n["prompt", "x"]\n')
    with pytest.raises(ValueError, match=f"{path}:2: a record must be a JSON object"):
        data.from_jsonl(path)


def test_missing_field_names_field_file_and_line(tmp_path):
    path = write(tmp_path / "pref.jsonl",
                 '{"prompt": "a", "chosen": "b", "rejected": "c"}\n'
                 '{"prompt": "a", "chosen": "b"}\n')
    with pytest.raises(KeyError) as e:
        data.from_jsonl(path, fields=data.PREFERENCE_FIELDS)
    message = str(e.value)
    assert "'rejected'" in message and f"{path}:2" in message
    renamed = write(tmp_path / "q.jsonl", '{"text": "a"}\n')
    with pytest.raises(KeyError, match=r"'prompt' \(stored as 'question'\)"):
        data.from_jsonl(renamed, fields={"prompt": "question"})


def test_wrong_field_type_is_reported(tmp_path):
    path = write(tmp_path / "t.jsonl", '{"prompt": 17}\n')
    with pytest.raises(ValueError, match=f"{path}:1: field 'prompt' must be a string"):
        data.from_jsonl(path, fields=data.PROMPT_FIELDS)


def test_empty_missing_and_directory_paths_are_reported(tmp_path):
    empty = write(tmp_path / "empty.jsonl", "\n  \n")
    with pytest.raises(ValueError, match="is empty"):
        data.from_jsonl(empty)
    with pytest.raises(ValueError, match="is empty"):
        data.from_text(write(tmp_path / "empty.txt", ""))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.from_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.from_text(tmp_path / "nope.txt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        data.from_jsonl(tmp_path)
    with pytest.raises(ValueError, match="the list is empty"):
        data.from_list([])
    with pytest.raises(TypeError, match="fields=\\('prompt',\\)"):
        data.from_list([{"prompt": "a"}], fields="prompt")


def test_text_file_one_prompt_per_line(tmp_path):
    path = write(tmp_path / "p.txt", "first prompt\r\n\nsecond  prompt \nthird\n")
    source = data.from_text(path)
    assert [source[i] for i in range(len(source))] == [
        {"prompt": "first prompt"}, {"prompt": "second  prompt "}, {"prompt": "third"}]


def test_list_source_validates_and_copies():
    source = data.from_list([{"prompt": "a", "x": 1}, {"prompt": "b", "x": 2}], fields=["prompt"])
    assert isinstance(source, data.Source)
    record = source[0]
    record["prompt"] = "changed"
    assert source[0] == {"prompt": "a"}
    with pytest.raises(KeyError, match=r"list\[1\]: missing field 'response'"):
        data.from_list([{"prompt": "a", "response": "b"}, {"prompt": "c"}], fields=data.SFT_FIELDS)


# ---------------------------------------------------------------------------------------------
# TensorFlow Datasets: a tiny local builder in array_record format, read without TensorFlow.

PREFS = [{"prompt": f"question {i}", "chosen": f"good answer {i}", "rejected": f"bad {i}"}
         for i in range(7)]


class TinyPreferences(tfds.core.GeneratorBasedBuilder):
    """Seven preference triples plus an integer id."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        text = tfds.features.Text()
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
            "prompt": text, "chosen": text, "rejected": text,
            "id": tfds.features.Scalar(dtype=np.int64)}))

    def _split_generators(self, dl_manager):
        del dl_manager
        return {"train": self._generate_examples(range(5)),
                "test": self._generate_examples(range(5, 7))}

    def _generate_examples(self, ids):
        for i in ids:
            yield i, {**PREFS[i], "id": i}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    TinyPreferences(data_dir=str(data_dir), file_format="array_record").download_and_prepare()
    return str(data_dir)


def test_tfds_round_trip_by_name(tfds_dir):
    source = data.from_tfds("tiny_preferences", split="train", data_dir=tfds_dir)
    assert len(source) == 5
    records = [source[i] for i in range(len(source))]
    # TFDS shuffles on disk; the content must come back exactly, as str and int.
    assert sorted(records, key=lambda r: r["id"]) == [{**PREFS[i], "id": i} for i in range(5)]
    assert all(isinstance(r["prompt"], str) and type(r["id"]) is int for r in records)
    test = data.from_tfds("tiny_preferences", split="test", data_dir=tfds_dir,
                          fields=data.PREFERENCE_FIELDS)
    assert sorted(test[i]["prompt"] for i in range(len(test))) == ["question 5", "question 6"]
    assert set(test[0]) == set(data.PREFERENCE_FIELDS)
    sliced = data.from_tfds("tiny_preferences", split="train[:2]", data_dir=tfds_dir)
    assert len(sliced) == 2


def test_tfds_from_builder_and_field_mapping(tfds_dir):
    builder = TinyPreferences(data_dir=tfds_dir, file_format="array_record")
    source = data.from_tfds(builder, split="train", fields={"prompt": "prompt", "response": "chosen"})
    assert sorted(source[i]["response"] for i in range(5)) == [f"good answer {i}" for i in range(5)]


def test_tfds_errors_are_specific(tfds_dir, tmp_path):
    with pytest.raises(KeyError, match="missing field.*'response'"):
        data.from_tfds("tiny_preferences", split="train", data_dir=tfds_dir, fields=data.SFT_FIELDS)
    with pytest.raises(FileNotFoundError, match="data_dir"):
        data.from_tfds("tiny_preferences", data_dir=tmp_path / "missing")
    # Not prepared in this directory and downloads are off: a clear error, no network.
    with pytest.raises(ValueError, match="file_format='array_record'"):
        data.from_tfds("tiny_preferences", split="train", data_dir=str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets from local files.

def test_hf_datasets_from_local_jsonl(tmp_path):
    path = write(tmp_path / "sft.jsonl", "".join(
        json.dumps({"instruction": f"say {w}", "output": w, "n": i}) + "\n"
        for i, w in enumerate(["yes", "no", "maybe"])))
    source = data.from_hf_datasets(path, fields={"prompt": "instruction", "response": "output"},
                                   cache_dir=tmp_path / "cache")
    assert len(source) == 3
    assert [source[i] for i in range(3)] == [
        {"prompt": "say yes", "response": "yes"}, {"prompt": "say no", "response": "no"},
        {"prompt": "say maybe", "response": "maybe"}]
    with pytest.raises(KeyError, match="missing field.*'chosen'"):
        data.from_hf_datasets(path, fields=data.PREFERENCE_FIELDS, cache_dir=tmp_path / "cache")


def test_hf_datasets_saved_to_disk_and_in_memory(tmp_path):
    train = datasets.Dataset.from_dict({"prompt": ["a b", "c d"]})
    test = datasets.Dataset.from_dict({"prompt": ["e f"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    source = data.from_hf_datasets(str(tmp_path / "dd"), split="test", fields=data.PROMPT_FIELDS)
    assert len(source) == 1 and source[0] == {"prompt": "e f"}
    with pytest.raises(KeyError, match="no split 'validation'"):
        data.from_hf_datasets(str(tmp_path / "dd"), split="validation")
    assert data.from_hf_datasets(train)[1] == {"prompt": "c d"}


def test_hf_datasets_bad_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.from_hf_datasets(str(tmp_path / "none.jsonl"))
    odd = write(tmp_path / "data.xyz", "x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        data.from_hf_datasets(odd)
    empty = write(tmp_path / "empty.jsonl", "")
    with pytest.raises(ValueError, match="is empty"):
        data.from_hf_datasets(empty, cache_dir=tmp_path / "cache")


def test_optional_extras_are_imported_lazily():
    code = ("import sys, ppo_jax.data; "
            "print(sorted(m for m in ('tensorflow_datasets', 'datasets', 'array_record') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
