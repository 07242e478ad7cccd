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


def test_a_report_on_a_full_disk_is_one_line_and_leaves_the_old_report(tmp_path, monkeypatch, capsys):
    """A full disk while a report was written: eval.main printed the OSError's traceback. Now one line (exit 2);
    the staged report's temporaries are gone and the previous report is whole."""
    from eval import main as eval_main

    out = tmp_path / "report"
    with staged_outputs(out) as stage:
        write_text(stage.path("patterns.md"), "old")

    def report_on_a_full_disk(argv):
        with staged_outputs(out) as stage:
            write_text(stage.path("patterns.md"), "new")
            raise OSError(28, os.strerror(28))

    monkeypatch.setitem(eval_main.COMMANDS, "patterns", report_on_a_full_disk)
    with pytest.raises(SystemExit) as stop:
        eval_main.main(["patterns"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: [Errno 28] No space left on device; eval.main patterns stopped, and the reports it had not "
        "finished were not written (those there before are unchanged)")
    assert os.listdir(out) == ["patterns.md"] and (out / "patterns.md").read_text() == "old"
