"""notebooks/quickstart.ipynb runs top to bottom on CPU (nbclient), at the notebook's smoke size, and
shows its plots and tables inline."""

import os

import nbformat
from conftest import TEST_XLA_FLAGS
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks",
                        "quickstart.ipynb")


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The kernel inherits this environment: the notebook's smaller test size, one CPU device (not the
    # 8 fake devices of the test process), no network.
    monkeypatch.setenv("PPO_JAX_NOTEBOOK_TEST", "1")
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # conftest.py's compile flags, and why
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # A cell's limit guards against a hung kernel, not a slow one: on 2 cores beside the multi-process
    # tests, the pipeline cell took over 600 s (2026-11-28). Its speed is the demo benchmark's job.
    client = NotebookClient(nb, timeout=1500, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails

    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if o.output_type in ("display_data", "execute_result") and "image/png" in o.data]
    assert len(images) == 2  # the SFT/RM plot and the PPO curves
    tables = [o for o in outputs if o.output_type == "display_data" and "text/markdown" in o.data]
    assert len(tables) == 3 and "PPO answer" in tables[-1].data["text/markdown"]
    assert os.path.isfile(tmp_path / "runs" / "quickstart" / "ppo" / "hf" / "config.json")
    # The install cell ran without installing anything (ppo_jax is importable here).
    assert nb.cells[1].outputs == []

