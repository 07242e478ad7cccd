"""eval/profile_ops.py: self times, busy time and per-op sums of a profiler trace, against brute force."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eval import profile_ops


def _nested_intervals(rng, start, end, depth):
    """Random properly nested integer intervals inside [start, end) (distinct, possibly touching)."""
    out = []
    t = start
    while t < end - 1 and depth > 0:
        s = int(rng.integers(t, end - 1))
        e = int(rng.integers(s + 1, min(end, s + 1 + (end - start) // 2) + 1))
        out.append((s, e))
        if e - s > 2:
            out += _nested_intervals(rng, s, e, depth - 1)
        t = e
    return out


def _self_brute(intervals):
    """Unit cells of each interval not covered by any other interval strictly inside it."""
    own = []
    for i, (s, e) in enumerate(intervals):
        inside = [(a, b) for j, (a, b) in enumerate(intervals) if j != i and s <= a and b <= e and (a, b) != (s, e)]
        own.append(sum(1 for c in range(s, e) if not any(a <= c < b for a, b in inside)))
    return own


@pytest.mark.parametrize("seed", range(6))
def test_self_and_busy_times_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    intervals = list(dict.fromkeys(_nested_intervals(rng, 0, 400, 4)))
    assert len(intervals) > 5
    order = rng.permutation(len(intervals))  # events come in any order
    shuffled = [intervals[i] for i in order]
    assert profile_ops.self_times(shuffled) == pytest.approx(_self_brute(shuffled))
    assert sum(profile_ops.self_times(shuffled)) == pytest.approx(profile_ops.busy_time(shuffled))
    # Overlapping, unnested intervals (two streams): the union, cell by cell.
    other = [(int(a), int(a) + int(rng.integers(1, 50))) for a in rng.integers(0, 450, 20)]
    cells = {c for s, e in shuffled + other for c in range(s, e)}
    assert profile_ops.busy_time(shuffled + other) == len(cells)


def _event(pid, tid, ts, dur, op, name=None, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name or op,
            "args": {"hlo_op": op, "hlo_module": "jit_step", **args}}


def test_op_profile_sums_self_time_per_op_on_the_device_timeline(tmp_path):
    rng = np.random.default_rng(0)
    ops = ["gemm_fusion_dot.1", "loop_add_fusion", "input_reduce_fusion.3", "custom-call.7", "copy.2"]
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              _event(1, 5, 0.0, 1e6, "host-side-op")]  # host events are ignored when a device has ops
    expected = dict.fromkeys(ops, 0.0)
    t = {7: 10.0, 8: 15.0}  # two streams
    for _ in range(200):
        stream = int(rng.choice([7, 8]))
        op = ops[int(rng.integers(len(ops)))]
        dur = float(rng.uniform(1, 30))
        events.append(_event(2, stream, t[stream], dur, op, name=f"kernel_{op}", tf_op=f"jit(step)/layer/{op}"))
        expected[op] += dur
        t[stream] += dur + float(rng.uniform(0, 5))
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": events}, f)
    prof = profile_ops.op_profile(str(path))
    assert prof.timeline == "device"
    got = {r.op: r.total_us for r in prof.rows}
    assert got == pytest.approx({op: v for op, v in expected.items() if v})
    assert [r.total_us for r in prof.rows] == sorted((r.total_us for r in prof.rows), reverse=True)
    by_op = {r.op: r for r in prof.rows}
    assert by_op["gemm_fusion_dot.1"].category == "matmul"
    assert by_op["custom-call.7"].category == "attention / Pallas / cuDNN"
    assert by_op["input_reduce_fusion.3"].category == "reduction fusion"
    assert by_op["copy.2"].scope == "jit(step)/layer/copy.2"
    starts = [e["ts"] for e in events[3:]]
    ends = [e["ts"] + e["dur"] for e in events[3:]]
    assert prof.span_us == pytest.approx(max(ends) - min(starts))
    assert prof.busy_us == pytest.approx(profile_ops.busy_time(zip(starts, ends)))
    assert sum(prof.by_category.values()) == pytest.approx(prof.total_us)
    table = profile_ops.markdown(prof, top=3)
    assert "| category | ms | share |" in table and "scope |" in table
    assert sum(line.startswith("| `") for line in table.splitlines()) == 3  # the top 3 ops


def test_a_real_cpu_trace_is_found_and_summed(tmp_path, capsys):
    f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
    x = jax.random.normal(jax.random.key(0), (256, 256))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        f(x).block_until_ready()
    path = profile_ops.find_trace(str(tmp_path))
    prof = profile_ops.op_profile(path)
    assert prof.timeline == "host" and prof.rows
    assert 0 < prof.busy_us <= prof.span_us + 1e-6
    assert prof.total_us == pytest.approx(prof.busy_us, rel=0.05)  # one thread runs this program's thunks
    profile_ops.main([str(tmp_path), "--top", "2"])
    assert "| op | category | calls | ms | share | example event |" in capsys.readouterr().out


def test_missing_or_empty_traces_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz under"):
        profile_ops.find_trace(str(tmp_path))
    with pytest.raises(ValueError, match="no XLA op events"):
        profile_ops.op_profile({"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 1, "name": "x"}]})


def test_cli_errors_are_one_line_and_the_trace_read_is_named(tmp_path, capsys):
    good = tmp_path / "good.json"
    good.write_text(json.dumps([_event(1, 1, 0.0, 5.0, "fusion.1")]))
    profile_ops.main([str(good), "--top", "1"])
    assert capsys.readouterr().out.startswith(f"trace: {good}\n")
    zipped = tmp_path / "zipped.json"  # gzip without the suffix: read by content
    zipped.write_bytes(gzip.compress(good.read_bytes()))
    profile_ops.main([str(zipped)])
    assert "`fusion.1`" in capsys.readouterr().out
    truncated = tmp_path / "cut.json.gz"
    truncated.write_bytes(gzip.compress(good.read_bytes())[:-12])
    notjson = tmp_path / "x.json"
    notjson.write_text("{not json")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, message in ((tmp_path / "nope.json.gz", "no such file or folder"), (empty, "no perfetto_trace.json.gz"),
                          (truncated, "is not a readable trace"), (notjson, "is not a readable trace")):
        with pytest.raises(SystemExit) as e:
            profile_ops.main([str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and message in err and "Traceback" not in err, path
    (tmp_path / "dict.json").write_text("{}")
    with pytest.raises(SystemExit):
        profile_ops.main([str(tmp_path / "dict.json")])
    assert "not a Chrome/perfetto trace" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        profile_ops.main([str(good), "--top", "-2"])
    assert e.value.code == 2 and "must be >= 0, got -2" in capsys.readouterr().err
