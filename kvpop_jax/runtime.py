"""Which JAX this process runs on: the start-up line of `train.main` and `eval.main`, and the
loud warning when a GPU-sized job is about to run on CPU. Also the worker thread that compiles
the next program while the current one runs (`background_worker`), and the Ctrl-C handler and exit of the
command-line tools (`interrupt_outside_gc_callbacks`, `exit_at_once_on_interrupt`).

`pip install -e .` installs the CPU build of jaxlib everywhere, also on a GPU node; there a
recipe silently trains on CPU. The start-up line names the backend and the devices, and
`report_backend(gpu_reasons=...)` prints a warning box on stderr when the job is GPU-sized
(bf16 compute, or S >= `GPU_SEQ_LEN`) but JAX sees only a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import os
import re
import signal
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, TextIO

import jax
import jaxlib

GPU_SEQ_LEN = 8192  # sequences this long are GPU work (the paper's recipes use 16384)
GPU_INSTALL = 'pip install -e ".[cuda12]"'


def gpu_workload_reasons(*, compute_dtype: str | None = None, seq_len: int | None = None) -> list[str]:
    """Why a job is GPU-sized: bf16 compute (the recipes' GPU precision) or long sequences."""
    reasons = []
    if compute_dtype == "bfloat16":
        reasons.append("bfloat16 compute")
    if seq_len is not None and seq_len >= GPU_SEQ_LEN:
        reasons.append(f"sequences of {seq_len} tokens (>= {GPU_SEQ_LEN})")
    return reasons


def backend_line() -> str:
    """One line: jax/jaxlib versions, the default backend and the devices it sees."""
    devices = jax.devices()
    kinds = ", ".join(f"{n} x {kind}" for kind, n in Counter(d.device_kind for d in devices).items())
    line = f"jax {jax.__version__} (jaxlib {jaxlib.__version__}) on {jax.default_backend()}: {kinds}"
    if jax.process_count() > 1:
        line += f"; process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices in all"
    return line


@functools.cache
def source_digest(packages: tuple[str, ...]) -> str:
    """A sha256 of the Python files of this repository's top-level `packages` (folders beside kvpop_jax): what a
    resumed run or report was begun with, so that finishing it with other code (a `git pull` between a kill and
    the rerun) is noticed. Every .py file there counts, a scratch file too."""
    digest = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for package in packages:
        for name in sorted(os.listdir(os.path.join(root, package))):
            if name.endswith(".py"):
                with open(os.path.join(root, package, name), "rb") as f:
                    digest.update(f"{package}/{name}".encode() + b"\0" + f.read())
    return digest.hexdigest()


def out_of_memory(error: BaseException) -> str | None:
    """The first line of XLA's out-of-memory error (`RESOURCE_EXHAUSTED: Out of memory allocating N bytes.`) with
    the bytes asked for in GiB, or None for any other error."""
    if not isinstance(error, jax.errors.JaxRuntimeError) or "RESOURCE_EXHAUSTED" not in str(error):
        return None
    line = str(error).strip().splitlines()[0]
    asked = re.search(r"(\d{7,}) bytes", line)
    return line + (f" ({int(asked.group(1)) / 2**30:,.1f} GiB)" if asked else "")


def report_backend(gpu_reasons: list[str] | tuple[str, ...] = (), *, what: str = "this job",
                   out: TextIO | None = None, err: TextIO | None = None) -> bool:
    """Prints `backend_line()` to `out`; warns on `err` if `gpu_reasons` and there is no GPU.

    Returns whether it warned.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    print(backend_line(), file=out, flush=True)
    if not gpu_reasons or jax.default_backend() != "cpu":
        return False
    bar = "!" * 100
    print("\n".join([
        bar,
        f"WARNING: {what} is GPU work ({'; '.join(gpu_reasons)}) but JAX sees only a CPU.",
        f"  It will run on CPU, very slowly. On a CUDA GPU node, install the CUDA build of jax: {GPU_INSTALL}",
        "  (check with: python -c 'import jax; print(jax.devices())'). Set JAX_PLATFORMS=cuda to fail instead.",
        bar,
    ]), file=err, flush=True)
    return True


@contextlib.contextmanager
def background_worker(enabled: bool = True, name: str = "background") -> Iterator[ThreadPoolExecutor | None]:
    """One worker thread (None when not `enabled`), for compiling the next program ahead: XLA:CPU
    compiles on one core while a batched decode keeps about 1.5 of 2 busy, and on a GPU the host is
    idle while the device runs (a CPU train step keeps both cores busy: there it does not pay,
    BENCHMARKS.md stop 44). On exit, queued work is dropped; running work is waited for, unless the
    block raised (Ctrl-C's message then prints at once; the interpreter joins the thread)."""
    if not enabled:
        yield None
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True, cancel_futures=True)


def _interrupt(signum, frame) -> None:
    """SIGINT -> KeyboardInterrupt, raised outside any gc callback (jax registers one). An exception
    from a gc callback cannot propagate: Python prints "Exception ignored in: _xla_gc_callback" and
    goes on, so a Ctrl-C that landed after a long native call (tokenizing, loading data) was lost and
    the run carried on (an --overwrite deleted what the user had stopped it to keep)."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:  # sent again 5 ms later, once the callback has returned
            main = threading.main_thread().ident
            threading.Timer(0.005, signal.pthread_kill, (main, signum)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


@contextlib.contextmanager
def ctrl_c_kills() -> Iterator[None]:
    """Inside: Ctrl-C ends the process at once (SIG_DFL), also inside XLA's minutes-long compile, where Python
    defers its own handler until the compile returns. For work that writes nothing (a dry run, a throughput
    measurement). The handler before is restored after."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_at_once_on_interrupt(entry: Callable[[], object]) -> None:
    """Runs a command-line tool's `entry`; its Ctrl-C exit (SystemExit 130, after the tool has said what it left)
    skips the interpreter's teardown: the interrupted program may still be computing on another thread, and the
    teardown would free its buffers under it (a segfault, exit -11 or 139, in 3 of 7 and 3 of 9
    interrupts of `eval.main diagnose noise`, 4-12 s in)."""
    try:
        entry()
    except SystemExit as e:
        if e.code != 130:
            raise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def interrupt_outside_gc_callbacks() -> None:
    """Installs the SIGINT handler of the command-line tools (their `except KeyboardInterrupt` then sees
    every Ctrl-C); a SIGINT that the process ignores (started in the background) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt)
