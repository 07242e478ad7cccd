"""The start-up line, the GPU-work-on-CPU warning and the compile-ahead worker (kvpop_jax/runtime.py, train.main)."""

import io
import subprocess

import jax
import pytest

from helpers import REPO, tiny_flags, train_cmd, train_env
from kvpop_jax.runtime import GPU_INSTALL, backend_line, gpu_workload_reasons, report_backend


def test_gpu_workload_reasons():
    assert gpu_workload_reasons(compute_dtype="float32", seq_len=1024) == []
    assert gpu_workload_reasons(compute_dtype="auto", seq_len=8191) == []
    reasons = gpu_workload_reasons(compute_dtype="bfloat16", seq_len=16384)
    assert reasons == ["bfloat16 compute", "sequences of 16384 tokens (>= 8192)"]


def test_backend_line_names_versions_backend_and_devices():
    line = backend_line()
    assert line.startswith(f"jax {jax.__version__} (jaxlib ")
    assert f"on {jax.default_backend()}: {jax.device_count()} x {jax.devices()[0].device_kind}" in line


def test_report_warns_on_stderr_only_for_gpu_work_on_cpu():
    out, err = io.StringIO(), io.StringIO()
    assert not report_backend([], out=out, err=err)
    assert out.getvalue() == backend_line() + "\n" and err.getvalue() == ""
    out, err = io.StringIO(), io.StringIO()
    assert report_backend(["bfloat16 compute"], what="this training run", out=out, err=err)  # tests run on CPU
    assert "WARNING: this training run is GPU work (bfloat16 compute) but JAX sees only a CPU" in err.getvalue()
    assert GPU_INSTALL in err.getvalue() and out.getvalue() == backend_line() + "\n"


@pytest.mark.long
def test_train_main_prints_the_backend_and_warns_for_a_gpu_recipe_on_cpu(tmp_path, arch):
    argv = tiny_flags(str(tmp_path / "run"), arch, compute_dtype="bfloat16", dry_run=True)
    proc = subprocess.run(train_cmd(argv), cwd=REPO, env=train_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"jax {jax.__version__} (jaxlib" in proc.stdout and " on cpu: " in proc.stdout
    assert "WARNING: this dry run" in proc.stderr and "bfloat16 compute" in proc.stderr
    assert "per-device bytes" in proc.stdout  # and it still ran


def test_background_worker_runs_work_and_does_not_hold_up_an_error():
    import threading
    import time

    from kvpop_jax.runtime import background_worker

    with background_worker(False) as pool:
        assert pool is None
    with background_worker(name="ahead") as pool:
        assert pool.submit(lambda: threading.current_thread().name).result().startswith("ahead")
    release = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):  # the block's error leaves at once, the running task aside
        with background_worker() as pool:
            pool.submit(release.wait, 30)
            queued = pool.submit(lambda: "never")
            raise KeyboardInterrupt
    assert time.perf_counter() - t0 < 10 and queued.cancelled()
    release.set()


@pytest.mark.long  # a subprocess: ~10 s
def test_ctrl_c_that_lands_in_a_gc_callback_still_stops_the_tool():
    """jax registers a gc callback; Python only prints an exception raised in one ("Exception ignored in:
    _xla_gc_callback") and goes on. A Ctrl-C handled there was lost: train.main kept running (and its
    --overwrite deleted the run the user had stopped it to keep). Now it is raised after the callback.
    In a fresh interpreter, as the tools run (a test worker's other threads and handlers would interfere)."""
    import os
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, signal, sys, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as started from a terminal: a test worker
        import jax  # its own gc callback too                      # may ignore SIGINT, and children inherit that
        from kvpop_jax.runtime import interrupt_outside_gc_callbacks
        seen = []
        def callback(phase, info):
            if phase == "start" and not seen:
                seen.append(phase)
                signal.raise_signal(signal.SIGINT)  # handled at the callback's next bytecodes
                total = sum(range(100))
        gc.callbacks.append(callback)
        if sys.argv[1] == "handler":
            interrupt_outside_gc_callbacks()
        try:
            gc.collect()
            time.sleep(5)  # the interrupt comes here (a moment later), not inside the callback
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(0 if seen else 1)
    """)
    for mode, code in (("handler", 130), ("python's own", 0)):  # without the handler the Ctrl-C is lost
        proc = subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        assert proc.returncode == code, (mode, proc.returncode, proc.stderr[-2000:])


def test_a_tools_ctrl_c_exit_skips_the_interpreters_teardown():
    """eval.main and train.pretrain exited 130 through the interpreter's teardown (train.main did not), which frees
    the buffers of a program still computing on another thread: 3 of 7 (and 3 of 9) Ctrl-Cs of `eval.main diagnose
    noise` ended in a segfault (-11). A 130 exit now skips the teardown (its atexit handlers show it); other exits
    keep it."""
    import sys
    import textwrap

    script = textwrap.dedent("""
        import atexit, sys
        from kvpop_jax.runtime import exit_at_once_on_interrupt
        atexit.register(lambda: print("teardown", flush=True))
        print("said", flush=True)
        exit_at_once_on_interrupt(lambda: sys.exit(int(sys.argv[1])))
    """)
    for code, teardown in ((130, False), (2, True), (0, True)):
        proc = subprocess.run([sys.executable, "-c", script, str(code)], capture_output=True, text=True, timeout=120,
                              cwd=REPO)
        assert proc.returncode == code and proc.stdout.split() == ["said"] + ["teardown"] * teardown, proc
    for module in ("eval/main.py", "train/main.py", "train/pretrain.py"):  # the tools' entry points use it
        assert "exit_at_once_on_interrupt(" in open(f"{REPO}/{module}").read().split('if __name__ == "__main__":')[1]


def test_ctrl_c_kills_restores_the_handler_before():
    """The dry run's and train.throughput's "Ctrl-C ends it at once" scope: SIG_DFL inside (also where SIGINT was
    ignored, as in a test worker's children), the previous handler after, also after an error."""
    import signal

    from kvpop_jax.runtime import ctrl_c_kills

    previous = signal.getsignal(signal.SIGINT)
    try:
        def mine(signum, frame):
            pass

        signal.signal(signal.SIGINT, mine)
        with pytest.raises(RuntimeError):
            with ctrl_c_kills():
                assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
                raise RuntimeError("the work failed")
        assert signal.getsignal(signal.SIGINT) is mine
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with ctrl_c_kills():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
