"""notebooks/explore.ipynb executes top to bottom (small sizes), so it never rots."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "explore.ipynb")


def test_notebook_is_built_from_its_source(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_explore", os.path.join(REPO, "notebooks", "build_explore.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(str(tmp_path / "nb.ipynb"))
    fresh = [c.source for c in nbformat.read(tmp_path / "nb.ipynb", as_version=4).cells]
    committed = [c.source for c in nbformat.read(NOTEBOOK, as_version=4).cells]
    assert fresh == committed, "run `python notebooks/build_explore.py` after editing its cells"


def test_notebook_build_is_byte_identical(tmp_path):
    """A rebuild of unchanged cells changes nothing (nbformat's random cell ids made every rebuild a diff)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_explore", os.path.join(REPO, "notebooks", "build_explore.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build(str(tmp_path / "a.ipynb"))
    module.build(str(tmp_path / "b.ipynb"))
    fresh = (tmp_path / "a.ipynb").read_bytes()
    assert fresh == (tmp_path / "b.ipynb").read_bytes()
    with open(NOTEBOOK, "rb") as f:
        assert fresh == f.read(), "run `python notebooks/build_explore.py` after editing its cells"


@pytest.mark.long
def test_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOP_NB_SEQ_LEN", "192")
    monkeypatch.setenv("KVPOP_NB_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Started outside the repo, as in Colab (/content, the clone installed with `pip install -e .`): the
    # notebook finds the shipped checkpoints through kvpop_jax's location (it fell back to random weights).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(elsewhere)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "budget" in outputs and "extracted:" in outputs
    assert os.path.isfile(tmp_path / "out" / "patterns.png")
    # The trained export decodes at the notebook's budget (CR 88% of the prompt, here raised to the
    # export's s + w + state + 1), not at the k it was trained with, which ignored the budget knob.
    from kvpop_jax import Qwen3Config

    config = Qwen3Config.from_hf(os.path.join(REPO, "checkpoints", "demo-kvpop-mlstm"))
    least = config.kvpop.memory(config.head_dim) - config.kvpop.topk + 1
    assert f"at memory {least} per KV head (k {config.kvpop.topk} -> 1)" in outputs
    assert "same as JAX: True" in outputs
    assert "no trained teacher found" not in outputs and "correct: 1.0" in outputs
