"""eval/outputs.py: report files staged under temporary names and renamed together."""

import os
import re
import subprocess
import sys

import pytest

from eval import main as eval_main
from eval.accuracy import run_accuracy
from eval.bench_decode import run_bench_decode
from eval.bench_gpu import run_bench_gpu
from eval.bench_train import run_bench_train
from eval.dms_patterns import run_dms_patterns
from eval.outputs import staged_outputs
from eval.patterns import run_patterns
from eval.plots import write_text
from eval.recall import run_recall
from helpers import HOLD_LOCK, REPO, hold_lock
from train.run_dir import LOCK_FILE, lock_run_dir


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


def test_a_report_killed_while_it_writes_a_file_leaves_nothing_the_next_report_keeps(tmp_path):
    """write_text into a staged name writes through a temporary of its own, named by mkstemp without the PID
    (`.tmp-RANDOM.tmp-PID-accuracy.md`): a report killed in that write left it for good, as no sweep could tell
    whose it was. Here the child is killed (os._exit) between the write and the rename."""
    out = tmp_path / "report"
    killed = subprocess.run([sys.executable, "-c", f"""
import os
from eval.outputs import staged_outputs
from eval.plots import write_text
os.fsync = lambda fd: os._exit(9)
with staged_outputs({str(out)!r}) as stage:
    write_text(stage.path("accuracy.md"), "new")
"""], cwd=REPO)
    assert killed.returncode == 9 and [n for n in os.listdir(out) if n.startswith(".tmp-")]
    with staged_outputs(out) as stage:
        write_text(stage.path("accuracy.md"), "next")
    assert sorted(os.listdir(out)) == ["accuracy.md"]


def test_a_report_on_a_full_disk_is_one_line_and_leaves_the_old_report(tmp_path, monkeypatch, capsys):
    """A full disk while a report was written: eval.main printed the OSError's traceback. Now one line (exit 2);
    the staged report's temporaries are gone and the previous report is whole."""
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


def test_out_of_memory_is_one_line_naming_what_was_asked_and_what_to_lower(monkeypatch, capsys):
    """`accuracy --max_new_tokens 1000000000` (a typed extra digit) ended in a 40-line traceback of XLA's
    RESOURCE_EXHAUSTED. Now one line with the GiB asked for and the flags that ask for less (exit 2); any other
    runtime error still raises."""
    import jax

    def decode(message):
        def run(argv):
            raise jax.errors.JaxRuntimeError(message)
        return run

    monkeypatch.setitem(eval_main.COMMANDS, "accuracy", decode("RESOURCE_EXHAUSTED: Out of memory allocating "
                                                              "2080002135440 bytes.\nmore lines"))
    with pytest.raises(SystemExit) as stop:
        eval_main.main(["accuracy"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: RESOURCE_EXHAUSTED: Out of memory allocating 2080002135440 bytes. (1,937.2 GiB) on "
        f"{jax.default_backend()}: eval.main accuracy stopped. Ask for less at once: fewer --problem_batch or "
        "rollouts per batch, a lower --max_new_tokens, shorter prompts or --seq_len")
    monkeypatch.setitem(eval_main.COMMANDS, "accuracy", decode("INTERNAL: something else"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        eval_main.main(["accuracy"])


# One call per eval writer of --out_dir; arguments that would fail (or run) only after the lock is taken.
WRITERS = {
    "accuracy": lambda out: run_accuracy(["dense"], {}, "missing.jsonl", out_dir=out),
    "recall": lambda out: run_recall("missing", "missing.jsonl", out_dir=out),
    "patterns": lambda out: run_patterns("missing", [1, 2, 3], out_dir=out),
    "dms_patterns": lambda out: run_dms_patterns("missing", "missing.jsonl", out_dir=out),
    "bench decode": lambda out: run_bench_decode(lengths=(), out_dir=out, benchmarks_md=None),
    "bench train": lambda out: run_bench_train(seq_lens=(), out_dir=out, benchmarks_md=None),
    "bench gpu": lambda out: run_bench_gpu(stages=(), out_dir=out, benchmarks_md=None),
}


WRITER_FUNCTIONS = {"accuracy": run_accuracy, "recall": run_recall, "patterns": run_patterns,
                    "dms_patterns": run_dms_patterns, "bench decode": run_bench_decode,
                    "bench train": run_bench_train, "bench gpu": run_bench_gpu}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_folder_where_any_writers_report_file_goes_is_refused_before_the_work(tmp_path, writer):
    """Only `accuracy` checked its file names up front; recall, patterns and the benches found a folder named like
    one of their files at the renames, after the work (minutes to hours of it). Every writer now checks them first."""
    function = WRITER_FUNCTIONS[writer]
    module = __import__(function.__module__, fromlist=["_"])
    with open(module.__file__) as f:  # the names checked are the names written
        written = set(re.findall(r'out\.path\("([^"]+)"\)|os\.path\.join\(out_dir, "([^"]+)"\)', f.read()))
    assert {a or b for a, b in written} == set(function.report_files)
    for name in function.report_files:
        out = tmp_path / name.replace(".", "_")
        (out / name).mkdir(parents=True)
        with pytest.raises(ValueError, match=re.escape(f"{out / name} is a folder, not a file")):
            WRITERS[writer](str(out))


@pytest.mark.parametrize("writer", WRITERS)
def test_a_report_folder_another_eval_writes_is_refused_at_once(tmp_path, writer):
    """Two eval commands into one --out_dir (the same command launched twice, or two commands sharing a folder)
    wrote their files into it together, and the folder silently mixed two runs. Each writer now holds
    OUT/run.lock (as a training run holds its folder's) and a second one is refused before any work."""
    out = str(tmp_path / "report")
    holder = hold_lock(out)
    try:
        with pytest.raises(ValueError, match=re.escape(
                f"report folder {out} in use by PID {holder.pid} (lock {os.path.realpath(out)}/{LOCK_FILE}); wait "
                "for that run, or stop it, or choose another --out_dir")):
            WRITERS[writer](out)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert os.listdir(out) == [LOCK_FILE]  # nothing written


def test_eval_main_refuses_a_locked_out_dir_in_one_line(tmp_path, capsys):
    out = str(tmp_path / "report")
    holder = hold_lock(out)
    try:
        with pytest.raises(SystemExit) as stop:
            eval_main.main(["bench", "gpu", "--stages=none", f"--out_dir={out}"])
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"error: report folder {out} in use by PID {holder.pid} (lock "
                                    f"{os.path.realpath(out)}/{LOCK_FILE}); wait for that run, or stop it, or "
                                    "choose another --out_dir")
    assert "Traceback" not in err


def test_a_lock_held_by_another_program_with_other_bytes_in_it_is_still_named(tmp_path):
    """A run.lock flocked by another program that wrote non-UTF-8 bytes into it: the refusal was the codec's
    "'utf-8' codec can't decode byte 0xff ...", naming neither the folder nor the lock."""
    out = str(tmp_path / "report")
    script = HOLD_LOCK.replace('b"%d\\n" % os.getpid()', 'b"\\xff\\xfe\\x00lock"')
    assert script != HOLD_LOCK
    holder = hold_lock(out, script)
    try:
        owner = "\ufffd\ufffd\x00lock"  # the bytes as decoded with replacement characters
        with pytest.raises(ValueError, match=re.escape(f"report folder {out} in use by PID {owner} (lock ")):
            WRITERS["accuracy"](out)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_report_folder_this_process_holds_is_not_refused(tmp_path):
    """The recipe evaluates in-process while it holds its run folder's lock: a lock this process holds nests."""
    out = str(tmp_path / "report")
    with lock_run_dir(out):
        with pytest.raises(ValueError, match="stages must be a non-empty subset"):
            run_bench_gpu(stages=(), out_dir=out, benchmarks_md=None)
        with lock_run_dir(out):
            pass


def test_bench_decode_budget_line_names_the_slots_and_memory_b():
    """B is memory per KV head (README, --dry_run, recall); the decode report said "(B=106) ...; memory 123"."""
    from eval.bench_decode import _budget_line

    kv = dict(sinks=4, window=32, topk=70, budget=106, scorer="mlstm")
    assert _budget_line({**kv, "memory": 123}, None) == ("- Budget: s=4, w=32, k=70: 106 slots + 17 of scorer state "
                                                         "= memory B 123 per KV head, scorer mlstm; baselines at the "
                                                         "same memory")
    assert "106 slots = memory B 106 per KV head, scorer mlp" in _budget_line({**kv, "memory": 106, "scorer": "mlp"},
                                                                              None)


def test_a_folder_where_a_report_file_goes_is_refused_before_any_rename(tmp_path):
    """A folder named like a report file (accuracy.json/) made os.replace fail halfway through the renames, after
    the whole run: the files renamed before it were new, the rest old, and the temporaries stayed. Now the renames
    start only when every one can be made, and a file named up front is checked before the work."""
    out = tmp_path / "report"
    with staged_outputs(out) as stage:
        for name in ("samples.jsonl", "accuracy.md"):
            write_text(stage.path(name), "old")
    (out / "accuracy.json").mkdir()
    folder = re.escape(f"{out / 'accuracy.json'} is a folder, not a file")
    with pytest.raises(ValueError, match=folder):
        with staged_outputs(out) as stage:
            for name in ("samples.jsonl", "accuracy.md", "accuracy.json"):
                write_text(stage.path(name), "new")
    assert sorted(os.listdir(out)) == ["accuracy.json", "accuracy.md", "samples.jsonl"]
    assert (out / "samples.jsonl").read_text() == (out / "accuracy.md").read_text() == "old"
    worked = []
    with pytest.raises(ValueError, match=folder):
        with staged_outputs(out, ("samples.jsonl", "accuracy.json")):
            worked.append(1)
    assert not worked


def test_a_file_written_into_the_stage_is_synced_before_it_is_renamed(tmp_path, monkeypatch):
    """samples.jsonl is written with open() into its temporary and was renamed unsynced: a crash soon after the
    rename could leave an empty samples.jsonl beside a whole accuracy.md. Each temporary is now synced first."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with staged_outputs(tmp_path / "report") as stage:
        with open(stage.path("samples.jsonl"), "w") as f:
            f.write("{}\n")
        tmp = stage.path("samples.jsonl")
    assert events.index(("fsync", tmp)) < events.index(("replace", tmp))
