"""docs/hf_models.md section 5, run as written (issue 33): make_tiny.py, PPO through the command line,
the export and the check, in a fresh directory with the section 4 prompts. The figures the guide
prints are the ones a fresh run gives, and the exported tokenizer is the one the run used."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import TEST_XLA_FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(REPO, "docs", "hf_models.md")


def _section(text: str, number: int) -> str:
    start = text.index(f"\n## {number}.")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_train_then_export_section_runs_as_written(tmp_path):
    text = open(GUIDE).read()
    prompts = _blocks(_section(text, 4), "json")[0]
    make_tiny = _blocks(_section(text, 5), "python")[0]
    script = _blocks(_section(text, 5), "bash")[0]
    (tmp_path / "prompts.jsonl").write_text(prompts)
    (tmp_path / "make_tiny.py").write_text(make_tiny)
    os.symlink(os.path.join(REPO, "configs"), tmp_path / "configs")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
           "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout.splitlines()

    # The figures in the guide's comments are what this run printed.
    expected = [line[2:] for line in script.splitlines() if line.startswith("# ")]
    done = [line for line in printed if line.startswith("done: ")]
    assert len(done) == 1
    numbers = lambda line: [float(x) for x in re.findall(r"-?\d+\.\d+", line)]  # noqa: E731
    assert numbers(done[0]) == pytest.approx(numbers(expected[0]), abs=2e-3), (done[0], expected[0])
    assert printed[-1] == expected[1]  # the prompt's token ids: the words survive the export

    # The export wrote back the tokenizer the run used, not a rebuilt one.
    source = json.loads((tmp_path / "models" / "tiny-qwen2" / "tokenizer.json").read_text())
    exported = json.loads((tmp_path / "runs" / "tiny_qwen2" / "hf" / "tokenizer.json").read_text())
    assert exported["model"] == source["model"] and exported["model"]["type"] == "WordLevel"
