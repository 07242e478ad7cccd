"""eval.recall, eval.patterns and eval.bench_decode on a tiny random KVpop checkpoint."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from eval.bench_decode import parse_lengths, run_bench_decode, tiny_config
from eval.dms_patterns import run_dms_patterns
from eval.patterns import run_patterns
from eval.recall import load_rows, memory_note, policy_arrays, run_recall
from helpers import assert_a_failed_rerun_keeps_the_report
from kvpop_jax import KVpopConfig, Qwen3Config, dms_cache, load_pretrained, policy, save_pretrained
from kvpop_jax.config import DMSConfig
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params, retrofit_params

BASE = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0)
KV = KVpopConfig(sinks=2, window=4, topk=6, scorer="mlp", scorer_hidden=8)
CONFIG = dataclasses.replace(BASE, kvpop=KV)
SEQ = 40  # > B = 12: every sampled query is saturated


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A KVpop export with random scorers (zero-initialized ones would be pure recency) and
    the demo tokenizer (92 tokens <= vocab 96)."""
    from demo.tokenizer import save_tokenizer

    params = retrofit_params(CONFIG, init_params(BASE, jax.random.key(0)), jax.random.key(1))
    rng = np.random.default_rng(0)
    flat = traverse_util.flatten_dict(params, sep="/")
    flat = {k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) if "/kvpop/" in k else v
            for k, v in flat.items()}
    path = str(tmp_path_factory.mktemp("kvpop_ckpt"))
    save_pretrained(CONFIG, traverse_util.unflatten_dict(flat, sep="/"), path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def recall_run(checkpoint, tmp_path_factory):
    ids = np.random.default_rng(1).integers(0, BASE.vocab_size, size=(3, SEQ))
    out = tmp_path_factory.mktemp("recall")
    result = run_recall(checkpoint, ids, num_sequences=3, num_queries=8, out_dir=out, teacher=checkpoint,
                        batch_size=2, progress=False)
    return ids, result


def _nonempty(path):
    return os.path.isfile(path) and os.path.getsize(path) > 0


def _topk_set(priority, q, k):
    """Brute force: the k best of E(q) = [s, q - w] by priority, ties to the earlier position."""
    eligible = range(KV.sinks, q - KV.window + 1)
    return set(sorted(eligible, key=lambda t: (-priority[t], t))[:k])


def _brute_force_hits(row, log_gamma, q_idx, k):
    """int [L, Hkv, N]: per row b, the sum over its queries of |student top-k & teacher top-k|, with
    `row(key, b)` the [L, Hkv, S] raw scores / targets of row b and priorities p_t = r_t - t log γ."""
    t = np.arange(SEQ, dtype=np.float32)
    n = q_idx.shape[0]
    hits = np.zeros((BASE.num_hidden_layers, BASE.num_key_value_heads, n), int)
    for layer, head, b in np.ndindex(*hits.shape):
        lg = log_gamma[layer, head]
        student = row("scores", b)[layer, head] - t * lg
        teacher = row("target", b)[layer, head] - t * lg
        hits[layer, head, b] = sum(len(_topk_set(student, q, k) & _topk_set(teacher, q, k)) for q in map(int, q_idx[b]))
    return hits


def test_recall_equals_brute_force_top_k(checkpoint, recall_run):
    ids, result = recall_run
    for key in ("md", "png", "json"):
        assert _nonempty(result.files[key])
    num_layers, num_heads = BASE.num_hidden_layers, BASE.num_key_value_heads
    assert result.recall.shape == (num_layers, num_heads)
    q_idx = result.query_positions
    assert q_idx.shape == (3, 8) and q_idx.min() >= KV.budget and q_idx.max() < SEQ
    # Saturated queries: the teacher keeps exactly k long-range tokens at each.
    np.testing.assert_array_equal(result.totals, 3 * 8 * KV.topk)

    # Brute force from the raw scores and targets of the forward passes run_recall made (its
    # batches of 2: rows [0, 1] and [2, padding]; compilation-cache hits), independent of the
    # ranks, cutoffs and keep-set code.
    config, params = load_pretrained(checkpoint)
    model = Qwen3ForCausalLM(config)
    batches = [{k: np.asarray(v) for k, v in policy_arrays(model, params, jnp.asarray(ids[r]),
                                                           jnp.asarray(q_idx[r])).items()} for r in ([0, 1], [2, 0])]
    row = lambda key, b: batches[b // 2][key][..., b % 2, :, :]  # noqa: E731  [L, Hkv, S]
    hits = _brute_force_hits(row, batches[0]["log_gamma"], q_idx, KV.topk)
    np.testing.assert_allclose(result.recall, hits.sum(-1) / (3 * 8 * KV.topk), rtol=0, atol=1e-12)
    # The model's own training metric on the first batch (its first 32 queries: all 8) agrees.
    first = hits[..., :2].sum(axis=(1, 2)) / (2 * num_heads * 8 * KV.topk)
    assert float(batches[0]["teacher_recall"]) == pytest.approx(first.mean(), abs=1e-6)

    # Token accuracy over every position with a next token; the teacher is the same weights, dense.
    pred = np.stack([batches[b // 2]["argmax"][b % 2] for b in range(3)])
    assert result.token_accuracy["all"] == pytest.approx(float((pred[:, :-1] == ids[:, 1:]).mean()), abs=1e-6)
    dense = np.asarray(Qwen3ForCausalLM(dataclasses.replace(config, kvpop=None)).apply(
        {"params": params}, jnp.asarray(ids)).logits.argmax(-1))
    agree = float((dense[:, :-1] == pred[:, :-1]).mean())
    assert result.teacher["agreement"]["all"] == pytest.approx(agree, abs=1e-6)
    assert agree < 1.0  # the sparse mask changed some predictions: the comparison can fail

    md = open(result.files["md"]).read()
    assert f"{result.global_mean:.3f}" in md and "| layer | mean | min | max |" in md
    assert json.load(open(result.files["json"]))["global_mean"] == pytest.approx(result.global_mean)


def test_token_accuracy_counts_the_next_token_over_all_and_saturated_positions(checkpoint, tmp_path, rng):
    """Rows built so the KVpop model's argmax is right about half the time (each next token is, by a coin, its
    own prediction or a random id): accuracy is the share of positions t < S - 1 whose argmax is ids[t + 1],
    "saturated" that share over t >= B. On random rows the accuracy is 0 whatever is compared, so comparing
    the argmax with ids[t] itself, or counting t = B - 1 as saturated, passed."""
    config, params = load_pretrained(checkpoint)
    forward = jax.jit(lambda x: Qwen3ForCausalLM(config).apply({"params": params}, x).logits.argmax(-1))
    ids = rng.integers(0, BASE.vocab_size, size=(3, SEQ))
    for t in range(SEQ - 1):  # the argmax at t reads ids[:t + 1] only (causal, and so is the KVpop mask)
        pred = np.asarray(forward(jnp.asarray(ids)))
        take = rng.random(3) < 0.5
        ids[take, t + 1] = pred[take, t]
    pred = np.asarray(forward(jnp.asarray(ids)))
    right = pred[:, :-1] == ids[:, 1:]  # [N, S - 1]: position t predicts ids[t + 1]
    result = run_recall(checkpoint, ids, num_sequences=3, num_queries=4, out_dir=tmp_path, progress=False)
    assert 0.3 < right.mean() < 0.9
    assert result.token_accuracy["all"] == pytest.approx(right.mean(), abs=1e-6)  # a float32 mask
    assert result.token_accuracy["saturated"] == pytest.approx(right[:, KV.budget:].mean(), abs=1e-6)


def test_saturated_queries_are_distinct_sorted_and_in_range(rng):
    """Query positions: per row, min(num, S - B) distinct positions in [B, S), sorted; drawn with replacement,
    a query counted twice in the recall, and no test looked."""
    from eval.recall import sample_saturated_queries

    for _ in range(100):
        budget, span = int(rng.integers(1, 50)), int(rng.integers(1, 30))
        n, num = int(rng.integers(1, 4)), int(rng.integers(1, 40))
        q = sample_saturated_queries(np.random.default_rng(int(rng.integers(1 << 30))), n, seq_len=budget + span,
                                     budget=budget, num=num)
        assert q.shape == (n, min(num, span)) and q.dtype == np.int32
        for row in q:
            assert len(set(row.tolist())) == len(row) and (np.diff(row) > 0).all()
            assert row.min() >= budget and row.max() < budget + span


def test_recall_at_another_budget_equals_brute_force(checkpoint, tmp_path):
    """`budget=` measures at another memory B (k = B - s - w, the paper's Fig. 7 is at CR 75%):
    the brute-force keep sets of the retargeted model, at queries saturated for that B."""
    ids = np.random.default_rng(5).integers(0, BASE.vocab_size, size=(2, SEQ))
    k = 10  # B = 2 + 4 + 10 = 16 (the export's: 12)
    result = run_recall(checkpoint, ids, num_sequences=2, num_queries=6, out_dir=tmp_path, budget=16, progress=False)
    assert result.settings["topk"] == k and result.settings["budget"] == 16
    q_idx = result.query_positions
    assert q_idx.min() >= 16
    np.testing.assert_array_equal(result.totals, 2 * 6 * k)
    config, params = load_pretrained(checkpoint)
    config = dataclasses.replace(config, kvpop=dataclasses.replace(config.kvpop, topk=k))
    arrays = {key: np.asarray(v) for key, v in policy_arrays(Qwen3ForCausalLM(config), params, jnp.asarray(ids),
                                                             jnp.asarray(q_idx)).items()}
    hits = _brute_force_hits(lambda key, b: arrays[key][:, b], arrays["log_gamma"], q_idx, k).sum(-1)
    np.testing.assert_allclose(result.recall, hits / (2 * 6 * k), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="budget 5"):
        run_recall(checkpoint, ids, num_sequences=2, out_dir=tmp_path, budget=5, progress=False)
    with pytest.raises(ValueError, match=r"memory B 6 per KV head leaves it k = 0 \(s 2 \+ w 4; trained at k 6, "
                                         r"memory 12\)"):  # it said "this checkpoint has topk = 0"
        run_recall(checkpoint, ids, num_sequences=2, out_dir=tmp_path, budget=6, progress=False)
    for name, value in (("num_queries", 0), ("num_sequences", 0), ("num_queries", -3), ("budget", 0),
                        ("seq_len", -1)):  # 0 queries wrote a recall of 0.000; the others raised from deep inside
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1, got {value}"):
            run_recall(checkpoint, ids, out_dir=tmp_path, progress=False, **{name: value})
    with pytest.raises(ValueError, match="last_n must be an integer >= 1"):  # it drew an empty heat map and nan
        run_patterns(checkpoint, ids[0], out_dir=tmp_path, last_n=0)


def test_recall_reads_text_and_token_id_jsonl(checkpoint, tmp_path):
    docs = [list(range(5, 35)), list(range(40, 80))]
    id_file = tmp_path / "ids.jsonl"
    id_file.write_text("\n".join(json.dumps({"input_ids": d}) for d in docs) + "\n")
    ids, mask = load_rows(str(id_file), seq_len=SEQ, num_sequences=5)
    np.testing.assert_array_equal(ids.ravel(), np.concatenate([np.array(d) for d in docs])[:2 * SEQ][: ids.size])
    assert ids.shape == (1, SEQ) and mask[0, 29] == 0 and mask[0, 28] == 1  # 29 ends document 1

    text_file = tmp_path / "text.jsonl"
    text_file.write_text("\n".join(json.dumps({"text": "a1b2c3\nkeep a\nm+3=6\n" * 6}) for _ in range(4)) + "\n")
    result = run_recall(checkpoint, str(text_file), num_sequences=2, seq_len=SEQ, num_queries=8,
                        out_dir=tmp_path / "out", batch_size=2, progress=False)
    assert result.settings["num_sequences"] == 2 and result.settings["seq_len"] == SEQ
    assert 0.0 <= result.global_mean <= 1.0 and _nonempty(result.files["png"])


def test_document_rows_start_where_their_documents_start(checkpoint, tmp_path, capsys):
    """rows="documents": one row per document of >= seq_len tokens, its first seq_len tokens (the
    demo's prompts as they are run); shorter documents are skipped, none is mixed into another's row."""
    rng = np.random.default_rng(4)
    lengths = [SEQ + 7, SEQ - 3, SEQ, 2 * SEQ + 1]  # the second is too short
    docs = [rng.integers(0, BASE.vocab_size, size=n).tolist() for n in lengths]
    id_file = tmp_path / "ids.jsonl"
    id_file.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    ids, mask = load_rows(str(id_file), seq_len=SEQ, num_sequences=5, rows="documents")
    np.testing.assert_array_equal(ids, np.array([docs[0][:SEQ], docs[2][:SEQ], docs[3][:SEQ]]))
    assert mask[:, :-1].all() and not mask[:, -1].any()
    ids2, _ = load_rows(str(id_file), seq_len=SEQ, num_sequences=2, rows="documents")
    np.testing.assert_array_equal(ids2, ids[:2])
    stream, _ = load_rows(str(id_file), seq_len=SEQ, num_sequences=5)  # the stream cuts across documents
    assert not np.array_equal(stream[1], ids[1])
    with pytest.raises(ValueError, match=r"none of the 4 documents read holds seq_len=500 tokens \(longest 81\)"):
        load_rows(str(id_file), seq_len=500, num_sequences=1, rows="documents")
    with pytest.raises(ValueError, match=r"rows must be one of .*'rows'"):
        load_rows(str(id_file), seq_len=SEQ, num_sequences=1, rows="rows")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for rows in ("stream", "documents"):
        with pytest.raises(ValueError, match=r"empty.jsonl holds no documents"):
            load_rows(str(empty), seq_len=SEQ, num_sequences=1, rows=rows)

    text_file = tmp_path / "text.jsonl"
    texts = ["a1b2c3\nkeep a\nm+3=6\n" * (6 + i) for i in range(3)]
    text_file.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    result = run_recall(checkpoint, str(text_file), num_sequences=2, seq_len=SEQ, num_queries=8, rows="documents",
                        out_dir=tmp_path / "out", batch_size=2, progress=False)
    assert result.settings["rows"] == "documents" and result.settings["num_sequences"] == 2
    from kvpop_jax.checkpoint import checkpoint_tokenizer
    tok = checkpoint_tokenizer(checkpoint)
    first = np.array([tok(t)["input_ids"][:SEQ] for t in texts[:2]])
    capsys.readouterr()
    by_rows = run_recall(checkpoint, first, num_queries=8, out_dir=tmp_path / "out2", batch_size=2, progress=False)
    np.testing.assert_array_equal(result.hits, by_rows.hits)
    assert "warning: recall: 2 rows read, not the 8 asked for" in capsys.readouterr().err  # default num_sequences
    short_file = tmp_path / "short.jsonl"  # a source of short documents is not read to its end
    short_file.write_text("\n".join(json.dumps({"text": f"a{i % 10}"}) for i in range(250)) + "\n")
    with pytest.raises(ValueError, match=r"none of the 100 documents read holds seq_len=40"):
        load_rows(str(short_file), seq_len=SEQ, num_sequences=1, tokenizer=tok, rows="documents")


def test_patterns_counts_heads_of_the_final_query_mask(checkpoint, tmp_path):
    ids = np.random.default_rng(2).integers(0, BASE.vocab_size, size=60)
    result = run_patterns(checkpoint, ids, out_dir=tmp_path, last_n=30)
    for key in ("md", "png", "usage_png", "json"):
        assert _nonempty(result.files[key])
    q = len(ids) - 1
    np.testing.assert_array_equal(result.positions, np.arange(q - KV.window - 29, q - KV.window + 1))
    # Every head holds exactly k long-range tokens (60 tokens: saturated).
    np.testing.assert_array_equal(result.kept.sum(-1), KV.topk)

    # The full attention mask's last row (policy.kvpop_mask), minus sinks and window.
    config, params = load_pretrained(checkpoint)
    arrays = policy_arrays(Qwen3ForCausalLM(config), params, jnp.asarray(ids[None]))
    for layer in range(config.num_hidden_layers):
        mask = policy.kvpop_mask(arrays["ranks"][layer], arrays["cutoffs"][layer], sinks=KV.sinks, window=KV.window)
        last_row = np.asarray(mask)[0, :, q]  # [Hkv, S]
        np.testing.assert_array_equal(result.counts[layer], last_row[:, result.positions].sum(0))
        ages = q - np.nonzero(result.kept[layer, 0])[0]
        assert result.mean_age[layer, 0] == pytest.approx(ages.mean())

    text = ("a1b2c3\n" * 9)[:59]  # one token per character, + <bos>: 60 tokens (a compilation-cache hit)
    with_text = run_patterns(checkpoint, text, out_dir=tmp_path / "text", last_n=12)
    assert with_text.settings["seq_len"] == 60
    assert set(with_text.labels) <= set("abc123") | {"\\n"}
    assert "Most retained" in open(with_text.files["md"]).read()


def test_patterns_old_share_is_the_share_of_kept_tokens_in_the_older_half(checkpoint, tmp_path, rng):
    """head_usage's old share: of the long-range tokens a head keeps at the last query, the share in the older
    half of the evictable range [s, q - w] (54 positions here: its first 27). Mean ages were checked, old shares
    never, and moving the half's boundary by one position passed."""
    q = SEQ + 19  # 60 tokens, as the test above: a compilation-cache hit
    older = np.arange(KV.sinks, q - KV.window + 1)[: (q - KV.window + 1 - KV.sinks) // 2]
    for i in range(4):
        ids = rng.integers(0, BASE.vocab_size, size=q + 1)
        result = run_patterns(checkpoint, ids, out_dir=tmp_path / str(i), last_n=30)
        for layer, head in np.ndindex(*result.old_share.shape):
            kept = np.nonzero(result.kept[layer, head])[0]
            assert result.old_share[layer, head] == pytest.approx(np.isin(kept, older).mean()), (i, layer, head)


@pytest.mark.long
def test_bench_decode_kvpop_flat_dense_growing(tmp_path):
    bench_md = tmp_path / "BENCHMARKS.md"
    bench_md.write_text("# Benchmarks\n\nearlier results\n")
    config = tiny_config(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=16)
    rows = run_bench_decode(lengths=(64, 128), methods=("dense", "kvpop", "streaming"), out_dir=tmp_path / "out",
                            benchmarks_md=bench_md, model_config=config, steps=2, warmup=1,
                            command="pytest bench", progress=False)
    by = {(r.method, r.length): r for r in rows}
    assert [r.method for r in rows][:2] == ["kvpop", "kvpop"] and rows[-1].method == "dense"  # dense last
    assert by["kvpop", 64].cache_bytes == by["kvpop", 128].cache_bytes
    assert by["streaming", 64].cache_bytes == by["streaming", 128].cache_bytes
    assert by["dense", 128].cache_bytes > by["dense", 64].cache_bytes
    assert all(r.ms_median > 0 and r.rss_bytes > 0 for r in rows)
    text = bench_md.read_text()
    assert text.startswith("# Benchmarks\n\nearlier results\n")  # appended, not clobbered
    assert "`pytest bench`" in text and "| kvpop | 128 |" in text and "| dense | 64 |" in text
    assert "jax " + jax.__version__ in text
    for name in ("bench_decode.md", "bench_decode.png", "bench_decode.json"):
        assert _nonempty(tmp_path / "out" / name)


def test_a_failed_bench_decode_rerun_leaves_the_previous_report_whole(tmp_path, monkeypatch):
    """bench_decode.png, .json and .md were written one after another: a rerun that failed between them left a
    new plot and json beside the old table, nothing telling them apart. They are now staged and renamed together."""
    import eval.bench_decode as bench_decode

    config = tiny_config(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=16)
    kw = dict(lengths=(64,), methods=("dense",), out_dir=tmp_path, benchmarks_md=None, model_config=config, steps=1,
              warmup=0, progress=False)
    # bench_markdown runs after the plot and the json are (re)written
    assert_a_failed_rerun_keeps_the_report(tmp_path, monkeypatch, bench_decode, "bench_markdown",
                                           lambda: run_bench_decode(**kw), lambda: run_bench_decode(**kw),
                                           {"bench_decode.md", "bench_decode.png", "bench_decode.json"})


def test_parse_lengths():
    assert parse_lengths("1k, 2k,4096") == (1024, 2048, 4096)
    for text in ("0", "abc", "1k,x"):
        with pytest.raises(ValueError, match=f"--lengths must be positive ints like '1k,2k,4096', got '{text}'"):
            parse_lengths(text)


def test_a_failed_patterns_rerun_leaves_the_previous_report_whole(checkpoint, tmp_path, monkeypatch):
    import eval.patterns as patterns

    ids = np.random.default_rng(2).integers(0, BASE.vocab_size, size=60)
    # plot_head_usage runs after patterns.png is (re)drawn
    assert_a_failed_rerun_keeps_the_report(tmp_path, monkeypatch, patterns, "plot_head_usage",
                                           lambda: run_patterns(checkpoint, ids, out_dir=tmp_path, last_n=30),
                                           lambda: run_patterns(checkpoint, ids[::-1].copy(), out_dir=tmp_path,
                                                                last_n=30),
                                           {"patterns.md", "patterns.png", "head_usage.png", "patterns.json"})


def test_token_id_jsonl_with_a_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [4, 5\n')
    with pytest.raises(ValueError, match=r"ids.jsonl line 2 is not valid JSON"):
        load_rows(str(path), seq_len=4, num_sequences=1)


# --- DMS: the eviction-ratio heat map and bench decode rows ----------------------------------

DMS = DMSConfig(window=4, budget=SEQ, gate_hidden=8, logit_offset=0.0)  # a pool as long as the rows: no overflow


@pytest.fixture(scope="module")
def dms_checkpoint(tmp_path_factory):
    """A DMS export with random gates (offset 0: they evict about half the tokens)."""
    config = dataclasses.replace(BASE, dms=DMS)
    params = retrofit_params(config, init_params(BASE, jax.random.key(0)), jax.random.key(1))
    rng = np.random.default_rng(2)
    flat = traverse_util.flatten_dict(params, sep="/")
    flat = {k: jnp.asarray(rng.normal(size=v.shape).astype(np.float32)) if "/dms/" in k else v
            for k, v in flat.items()}
    path = str(tmp_path_factory.mktemp("dms_ckpt"))
    save_pretrained(config, traverse_util.unflatten_dict(flat, sep="/"), path)
    return path


def test_dms_patterns_match_the_decode_cache(dms_checkpoint, tmp_path):
    """Occupancy and eviction ratio from the parallel forward == what the bounded pool holds after
    decoding the same rows token by token (an independent path through dms_cache)."""
    ids = np.random.default_rng(3).integers(0, BASE.vocab_size, size=(3, SEQ))
    result = run_dms_patterns(dms_checkpoint, ids, num_sequences=3, out_dir=tmp_path / "out", batch=2)
    config, params = load_pretrained(dms_checkpoint)
    model = Qwen3ForCausalLM(config)
    cache = dms_cache.init_cache(config, 3)
    step = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c).cache)
    for t in range(SEQ):
        cache = step(cache, jnp.asarray(ids[:, t : t + 1]))
    occupancy = np.stack([np.asarray(dms_cache.occupancy(layer, BASE.num_key_value_heads))
                          for layer in cache.layers], axis=1)  # [N, L, Hkv]
    assert all((np.asarray(layer.overflow) == 0).all() for layer in cache.layers)
    np.testing.assert_array_equal(result.occupancy, occupancy)
    np.testing.assert_allclose(result.ratio, (SEQ - occupancy) / (SEQ - DMS.window))
    np.testing.assert_allclose(result.ratio_median, np.median(result.ratio, axis=0))
    assert result.ratio_median.shape == (BASE.num_hidden_layers, BASE.num_key_value_heads)
    assert 0.1 < result.ratio.mean() < 0.9 and result.occupancy.min() != result.occupancy.max()
    for name in ("png", "md", "json"):
        assert _nonempty(result.files[name])
    with pytest.raises(ValueError, match="never leave the DMS window"):
        run_dms_patterns(dms_checkpoint, ids[:, :4], out_dir=tmp_path / "short")


def test_dms_patterns_read_document_rows(dms_checkpoint, tmp_path, capsys):
    """rows="documents" (what the main job passes for its held-out prompts): each row is one document's
    first seq_len tokens, the same result as those rows given directly; the stream cuts across them."""
    rng = np.random.default_rng(5)
    docs = [rng.integers(0, BASE.vocab_size, size=n).tolist() for n in (SEQ + 5, SEQ - 2, SEQ + 9)]
    id_file = tmp_path / "ids.jsonl"
    id_file.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    by_docs = run_dms_patterns(dms_checkpoint, str(id_file), num_sequences=2, seq_len=SEQ, rows="documents",
                               out_dir=tmp_path / "docs", batch=2)
    direct = run_dms_patterns(dms_checkpoint, np.array([docs[0][:SEQ], docs[2][:SEQ]]), out_dir=tmp_path / "direct",
                              batch=2)
    np.testing.assert_array_equal(by_docs.occupancy, direct.occupancy)
    assert by_docs.settings["row_source"] == "documents"
    assert f"2 rows of {SEQ} tokens (documents)" in open(by_docs.files["md"]).read()
    stream = run_dms_patterns(dms_checkpoint, str(id_file), num_sequences=2, seq_len=SEQ, out_dir=tmp_path / "stream",
                              batch=2)
    assert not np.array_equal(stream.occupancy, by_docs.occupancy)
    from eval.main import cmd_patterns
    cmd_patterns(["--checkpoint", dms_checkpoint, "--data", str(id_file), "--num_sequences", "2", "--seq_len",
                  str(SEQ), "--rows", "documents", "--out_dir", str(tmp_path / "cli")])
    assert "(documents)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="rows must be one of"):
        run_dms_patterns(dms_checkpoint, str(id_file), seq_len=SEQ, rows="problems", out_dir=tmp_path / "bad")


def test_patterns_command_on_a_dms_export(dms_checkpoint, tmp_path, capsys):
    from eval.main import cmd_patterns

    ids = ",".join(str(t) for t in np.random.default_rng(4).integers(0, BASE.vocab_size, size=SEQ))
    cmd_patterns(["--checkpoint", dms_checkpoint, "--ids", ids, "--out_dir", str(tmp_path)])
    assert "DMS eviction patterns" in capsys.readouterr().out and _nonempty(tmp_path / "dms_patterns.png")
    with pytest.raises(ValueError, match="is a DMS export"):
        run_patterns(dms_checkpoint, [int(t) for t in ids.split(",")], out_dir=tmp_path / "kvpop")
    for last_n in ("-3", "5"):  # the DMS report ignored it, even an invalid one
        with pytest.raises(SystemExit):
            cmd_patterns(["--checkpoint", dms_checkpoint, "--ids", ids, "--last_n", last_n, "--out_dir",
                          str(tmp_path / "last_n")])
        assert f"--last_n={last_n} is for KVpop exports" in capsys.readouterr().err
    # a dataset's options with one --ids sequence, and --data's options for a KVpop export: ignored before
    for checkpoint, extra, message in (
            (dms_checkpoint, ["--rows", "documents", "--text_field", "text", "--num_sequences", "4"],
             "--num_sequences, --rows, --text_field are for --data"),
            ("checkpoints/demo-kvpop-mlstm", ["--num_sequences", "4"], "--num_sequences is for DMS exports; a KVpop "
                                                                       "export reports the one sequence of --text"),
            ("checkpoints/demo-kvpop-mlstm", ["--seq_len", "64"], "--seq_len is for DMS exports")):
        with pytest.raises(SystemExit):
            cmd_patterns(["--checkpoint", checkpoint, "--ids", ids, *extra, "--out_dir", str(tmp_path / "unused")])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


def test_bench_decode_dms_rows_have_a_fixed_pool(tmp_path):
    config = tiny_config(layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, vocab=64, sinks=2, window=8, topk=16)
    rows = run_bench_decode(lengths=(64, 128), methods=("dms", "kvpop"), out_dir=tmp_path / "out", benchmarks_md=None,
                            model_config=config, steps=2, warmup=1, command="pytest bench", progress=False)
    by = {(r.method, r.length): r for r in rows}
    assert by["dms", 64].cache_bytes == by["dms", 128].cache_bytes  # a fixed pool, whatever the length
    # the pool holds the KVpop memory per KV head (k, v and two int32 tags per entry, plus the ring)
    memory = config.kvpop.memory(config.head_dim)
    assert by["dms", 64].cache_bytes >= memory * 2 * config.head_dim * 4
    assert all(r.ms_median > 0 for r in rows)
    text = open(tmp_path / "out" / "bench_decode.md").read()
    assert "| dms | 128 |" in text and f"a pool of Hkv x {memory} entries per layer" in text


def test_a_text_file_that_is_not_utf8_is_named(tmp_path, capsys):
    from eval.main import main as eval_main

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 a1b2\n".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        eval_main(["patterns", "--checkpoint", "checkpoints/demo-kvpop-mlstm", "--text_file", str(bad),
                   "--out_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--text_file '{bad}' is not UTF-8 text" in err and "Traceback" not in err


def test_dms_patterns_check_the_rows_like_recall(dms_checkpoint, tmp_path, capsys):
    """DMS patterns refuse ids outside the vocabulary and bad row counts, and warn on fewer rows or rows past
    max_position_embeddings, as recall does (before, an id of 500 in a vocabulary of 61 gave a normal-looking
    report, num_sequences=-1 silently dropped the last document, and 0 blamed the data)."""
    rng = np.random.default_rng(6)
    docs = [rng.integers(0, BASE.vocab_size, size=SEQ + 3).tolist() for _ in range(3)]
    id_file = tmp_path / "ids.jsonl"
    id_file.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    kw = dict(seq_len=SEQ, rows="documents", out_dir=tmp_path / "out")
    for n in (0, -1):
        with pytest.raises(ValueError, match=f"num_sequences must be an integer >= 1, got {n}"):
            run_dms_patterns(dms_checkpoint, str(id_file), num_sequences=n, **kw)
    bad = tmp_path / "oov.jsonl"
    bad.write_text("\n".join(json.dumps(d[:5] + [v] + d[6:]) for d, v in zip(docs, (500, 1, -1))) + "\n")
    with pytest.raises(ValueError, match=rf"DMS patterns: token ids must lie in \[0, {BASE.vocab_size}\), got "
                                         r"\[-1, 500\]"):
        run_dms_patterns(dms_checkpoint, str(bad), num_sequences=3, **kw)
    capsys.readouterr()
    run_dms_patterns(dms_checkpoint, str(id_file), num_sequences=5, **kw)
    assert "warning: DMS patterns: 3 rows read, not the 5 asked for" in capsys.readouterr().err
    short = tmp_path / "short_positions"  # the same export, trained (it says) to SEQ - 8 positions
    shutil.copytree(dms_checkpoint, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": SEQ - 8}))
    run_dms_patterns(str(short), str(id_file), num_sequences=3, **kw)
    assert f"rows of {SEQ} tokens run past the model's max_position_embeddings {SEQ - 8}" in capsys.readouterr().err


def test_float_or_boolean_token_ids_are_named_not_read_as_text(tmp_path):
    """numpy/pandas write ids as 1.0: such lines were read as text (one line) or refused as 'not a JSON
    object' / 'no text field'; booleans were read as ids 1 and 0."""
    for i, (record, bad) in enumerate([([1.0, 5.0, 9.0], "1.0"), ({"input_ids": [3, 4.5]}, "4.5"),
                                       ([True, False, 3], "True")]):
        path = tmp_path / f"ids{i}.jsonl"
        path.write_text(json.dumps(record) + "\n" + json.dumps(record) + "\n")
        with pytest.raises(ValueError, match=rf"line 1: token ids must be JSON integers, got {bad}"):
            load_rows(str(path), seq_len=2, num_sequences=1)


def test_recall_names_the_slots_and_the_memory(recall_run):
    """`--budget` is memory B (slots + the scorer's state); the reports said "B=" of the slots alone."""
    text = open(recall_run[1].files["md"]).read()
    assert f"k={KV.topk}: {KV.budget} slots = memory B {KV.budget} per KV head, scorer mlp" in text  # stateless
    assert f"positions >= s + w + k ({KV.budget})" in text
    # the words of --dry_run, the recipe and the benches
    assert memory_note({"budget": 106, "memory": 123}) == "106 slots + 17 of scorer state = memory B 123 per KV head"
