"""Independent jobs of the recipe (`train/recipe.py`: its variants' trainings), run a few at a time
in worker processes.

One XLA CPU training keeps only ~1.5 of 2 cores busy (many of its ops run on one thread); two
trainings in two processes finish 1.3x sooner than one after the other (BENCHMARKS.md, stop 31).
So on a CPU the recipe trains its variants as jobs in `workers` spawned processes, each starting
a job as soon as the jobs named in its `after` are done; with `workers == 1` (an accelerator: one
job fills it) the jobs run in this process, in order, as before.

Each job is a picklable module-level function and its arguments; its result comes back
pickled. A training's outputs do not depend on which process ran it or when (same flags, same
seed, same data order; measured: the demo's summary is the same). A failed job stops the
scheduling: the running jobs finish (each training saves its own checkpoints, so a rerun
resumes), nothing new starts, and its exception is raised here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import time
from typing import Any, Callable, Hashable, Sequence

from kvpop_jax.runtime import PROGRESS_POSITION_ENV


@dataclasses.dataclass(frozen=True)
class Job:
    """`fn(*args, **kwargs)` once every job named in `after` has finished."""

    key: Hashable
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    after: tuple = ()


def _init_worker(slots) -> None:
    os.environ[PROGRESS_POSITION_ENV] = str(slots.get())  # this worker's row for its progress bars


def _timed(fn, args, kwargs) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t0


def run_jobs(jobs: Sequence[Job], workers: int, *,
             on_done: Callable[[Job, Any, float], None] | None = None) -> dict[Hashable, Any]:
    """Runs `jobs`, up to `workers` at a time; returns key -> result.

    Jobs start in list order among those whose `after` jobs are done. `on_done(job, result,
    seconds)` is called in this process as each finishes.
    """
    keys = [job.key for job in jobs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"job keys must be unique, got {keys}")
    for i, job in enumerate(jobs):
        unknown = [k for k in job.after if k not in keys[:i]]
        if unknown:
            raise ValueError(f"job {job.key!r} waits for {unknown}, which are not earlier jobs")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    results: dict[Hashable, Any] = {}
    if workers == 1 or len(jobs) < 2:
        for job in jobs:  # in order: every `after` job is earlier
            results[job.key], seconds = _timed(job.fn, job.args, job.kwargs)
            if on_done:
                on_done(job, results[job.key], seconds)
        return results
    ctx = multiprocessing.get_context("spawn")  # never fork a process that has started JAX's threads
    slots = ctx.Queue()
    for slot in range(workers):
        slots.put(slot + 1)  # row 0 is this process's
    pending, running = list(jobs), {}
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                                initargs=(slots,)) as pool:
        while pending or running:
            for job in [j for j in pending if all(k in results for k in j.after)][:workers - len(running)]:
                running[pool.submit(_timed, job.fn, job.args, job.kwargs)] = job
                pending.remove(job)
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                job = running.pop(future)
                try:
                    results[job.key], seconds = future.result()
                except BaseException:
                    pending.clear()  # the running jobs finish as the pool closes; nothing new starts
                    raise
                if on_done:
                    on_done(job, results[job.key], seconds)
    return results
