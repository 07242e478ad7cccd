"""`bench decode` rows for PyTorch (eval/bench_torch.py): KVpopCache flat, the dense cache growing."""

from eval import bench_torch
from eval.bench_decode import run_bench_decode, tiny_config


def test_torch_rows_kvpop_flat_dense_growing(tmp_path):
    config = tiny_config(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=16)
    rows = run_bench_decode(lengths=(64, 256), methods=("torch-kvpop", "torch-dense"), out_dir=tmp_path,
                            benchmarks_md=None, model_config=config, steps=2, warmup=1, progress=False)
    by = {(r.method, r.length): r for r in rows}
    assert set(by) == {(m, n) for m in ("torch-kvpop", "torch-dense") for n in (64, 256)}
    assert by["torch-kvpop", 64].cache_bytes == by["torch-kvpop", 256].cache_bytes
    assert by["torch-dense", 256].cache_bytes > 3 * by["torch-dense", 64].cache_bytes
    assert by["torch-kvpop", 256].cache_bytes < by["torch-dense", 256].cache_bytes
    assert all(r.ms_median > 0 and r.rss_bytes > 0 for r in rows)
    text = (tmp_path / "bench_decode.md").read_text()
    assert "| torch-kvpop | 256 |" in text and "kvpop_torch.KVpopCache" in text


def test_torch_rows_are_skipped_with_a_note_without_torch(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_torch, "torch_available", lambda: False)
    config = tiny_config(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=16)
    rows = run_bench_decode(lengths=(32,), methods=("kvpop", "torch-kvpop"), out_dir=tmp_path, benchmarks_md=None,
                            model_config=config, steps=1, warmup=0, progress=False)
    assert [r.method for r in rows] == ["kvpop"]
    assert bench_torch.SKIP_NOTE in (tmp_path / "bench_decode.md").read_text()
