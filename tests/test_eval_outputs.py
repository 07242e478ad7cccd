"""eval/outputs.py: report files staged under temporary names and renamed together."""

import os

import pytest

from eval.outputs import staged_outputs
from eval.plots import write_text


def test_a_killed_reports_temporaries_are_removed_by_the_next_report(tmp_path):
    """A SIGKILL skips the clean-up: `.tmp-PID-NAME` of a dead PID stayed in the folder for good, one set per
    killed rerun. A live process's temporaries (another report being written) and other files are kept."""
    out = tmp_path / "report"
    out.mkdir()
    dead, live = out / ".tmp-999999999-samples.jsonl", out / f".tmp-{os.getppid()}-accuracy.md"
    for path in (dead, live, out / "notes.txt", out / ".tmp-x-y"):
        path.write_text("x")
    with staged_outputs(out) as stage:
        write_text(stage.path("accuracy.md"), "new")
    assert sorted(os.listdir(out)) == sorted([live.name, "notes.txt", ".tmp-x-y", "accuracy.md"])
    with pytest.raises(RuntimeError):  # a failed report still removes only its own temporaries
        with staged_outputs(out) as stage:
            write_text(stage.path("samples.jsonl"), "half")
            raise RuntimeError
    assert (out / "accuracy.md").read_text() == "new" and live.exists()
