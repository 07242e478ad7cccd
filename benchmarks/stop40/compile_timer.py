"""A pytest plugin: per test, the seconds of each JAX compile stage and how many programs (stop 40).

    PYTHONPATH=benchmarks/stop40 python -m pytest -q -n 2 -p compile_timer tests/test_cache.py
    cat /tmp/compile_timer.txt.*   # one file per process: seconds <tab> event <tab> test

Events: jax.monitoring's `/jax/core/compile/backend_compile_duration` (XLA), `jaxpr_trace_duration`,
`jaxpr_to_mlir_module_duration`, each with a `#n` count, and `wall` (the test's call). A trace nested
inside another (a jitted function called in a traced one) is counted in both, so the tracing seconds
can exceed the time spent. COMPILE_TIMER_OUT sets the files' prefix.
"""

import collections
import os
import time

import pytest
from jax import monitoring

_TOTALS = collections.Counter()
_CURRENT = {"test": None}


def _listener(event, duration, **_):
    if _CURRENT["test"] is not None:
        _TOTALS[(_CURRENT["test"], event)] += duration
        _TOTALS[(_CURRENT["test"], event + "#n")] += 1


monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _CURRENT["test"] = item.nodeid
    start = time.perf_counter()
    yield
    _TOTALS[(item.nodeid, "wall")] += time.perf_counter() - start
    _CURRENT["test"] = None


def pytest_sessionfinish(session):
    if not _TOTALS:
        return
    with open(f"{os.environ.get('COMPILE_TIMER_OUT', '/tmp/compile_timer.txt')}.{os.getpid()}", "w") as f:
        for (test, event), value in sorted(_TOTALS.items()):
            f.write(f"{value:.3f}\t{event}\t{test}\n")
