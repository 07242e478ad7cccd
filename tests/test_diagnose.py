"""eval/diagnose.py: the pieces its tables are computed from, against the model's own cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import TINY_HF_CONFIGS
from eval.diagnose import _auc
from kvpop_jax.modeling import layer_qkv
from kvpop_jax import Qwen3Config
from kvpop_jax.cache import init_dense_cache
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params


def test_project_qkv_is_what_the_dense_cache_holds(rng):
    config = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    params = init_params(config, jax.random.key(4))
    ids = jnp.asarray(rng.integers(0, config.vocab_size, size=(2, 9)))
    cache = Qwen3ForCausalLM(config).apply({"params": params}, ids, cache=init_dense_cache(config, 2, 9)).cache
    for layer in range(config.num_hidden_layers):
        _, k, v = layer_qkv(config, params, ids, layer)  # [B, S, Hkv, D]; the cache is [B, Hkv, T, D]
        np.testing.assert_allclose(np.swapaxes(np.asarray(k), 1, 2), np.asarray(cache.layers[layer].k),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.swapaxes(np.asarray(v), 1, 2), np.asarray(cache.layers[layer].v),
                                   rtol=1e-5, atol=1e-5)


def test_auc_counts_pairs_ranked_right(rng):
    ranks = rng.permutation(12)[None].astype(float)  # one head; lower rank = kept first
    needed, others = [0, 3, 5], [1, 2, 4, 6, 7, 8, 9, 10, 11]
    brute = np.mean([ranks[0, n] < ranks[0, o] for n in needed for o in others])
    np.testing.assert_allclose(_auc(ranks, needed, others)[0], brute)


@pytest.mark.long
def test_learn_labels_the_marked_facts_among_the_eligible_binding_values(capsys):
    """`diagnose learn`'s data: y marks exactly the marked facts' value tokens, m the binding values
    eligible at the last prompt token (facts included); the run prints one AUC line per checkpoint."""
    import argparse

    from demo.task import generate_dataset
    from eval.diagnose import _learn_data, learn
    from kvpop_jax import load_pretrained
    from kvpop_jax.checkpoint import checkpoint_tokenizer

    teacher = "checkpoints/demo-teacher"
    config, params = load_pretrained(teacher)
    problems = generate_dataset(2, 5, "train", task="reuse", seq_len=1024)
    k, v, y, m, e, r = _learn_data(config, params, checkpoint_tokenizer(teacher), problems, 1, 0, 4, 32)
    assert k.shape == v.shape == (2, 1024, 1, config.head_dim) and y.shape == m.shape == (2, 1024)
    for i, ex in enumerate(problems):
        assert set(np.nonzero(np.asarray(y[i]))[0]) == {f["value_pos"] for f in ex["meta"]["facts"]}
        eligible = {p for p in ex["meta"]["binding_value_positions"] if 4 <= p <= 1023 - 32}
        assert set(np.nonzero(np.asarray(m[i]))[0]) == eligible | {f["value_pos"] for f in ex["meta"]["facts"]}
    assert e.shape == r.shape == (2, 1024) and np.asarray(e).sum(1).tolist() == [1024 - 32 - 4] * 2
    from kvpop_jax.modeling import dense_attention_probs
    ids = checkpoint_tokenizer(teacher)(problems[0]["text"])["input_ids"][:1024]
    probs = np.asarray(dense_attention_probs(config, params, jnp.asarray([ids]), 1))[0, :2]  # KV head 0's queries
    for t in (5, 300, 900):  # Eq. 2-3 by loops: max over the group of the mean over d >= t + w
        brute = max(sum(probs[g, d, t] for d in range(t + 32, 1024)) / (1024 - t - 32) for g in range(2))
        np.testing.assert_allclose(float(r[0, t]), np.log(brute), rtol=1e-4)
    from eval.diagnose import exact_log_target, group_probs
    probs1 = np.asarray(dense_attention_probs(config, params, jnp.asarray([ids]), 1))[0, 2:4]  # KV head 1's queries
    r1 = exact_log_target(group_probs(config, params, jnp.asarray([ids]), 1, 1), 32)[0]
    brute = max(sum(probs1[g, d, 300] for d in range(332, 1024)) / (1024 - 332) for g in range(2))
    np.testing.assert_allclose(float(r1[300]), np.log(brute), rtol=1e-4)
    for labels in ("told", "target_values", "target_listwise", "target_topk"):  # target_all: another mask
        args = argparse.Namespace(teacher=teacher, problems=4, seed=0, task="reuse", prompt_len=1024, layer=1,
                                  kv_head=0, sinks=4, window=32, budget=123, scorer="mlp", steps=4,
                                  scorer_keys="rotated", labels=labels, tau=0.5, label_k=3 if labels == "target_topk" else 0)
        history = learn(args)
        out = capsys.readouterr().out
        lines = [line for line in out.splitlines() if line.strip().startswith("step")]
        if labels == "target_topk":
            assert "membership of the exact target's top 3 (" in out  # --label_k, not k = 87
        assert len(lines) == 5 and all(0.0 <= float(x.split()[-1]) <= 1.0 for x in lines)
        assert float(lines[0].split()[-1]) == 0.5  # the fresh MLP's last layer is zero: every token ties
        assert len(history["loss"]) == 4 and np.isfinite(history["loss"]).all(), (labels, history["loss"])
        assert [row[0] for row in history["kept"]] == ["train", "validation"] * 5 and all(
            0.0 <= row[1] <= 1.0 for row in history["kept"])
        if labels == "told":
            assert history["auc"][-1][1] > 0.5  # four steps on the answer already rank the train facts higher
    with pytest.raises(ValueError, match="--tau must be > 0, got 0.0"):
        learn(argparse.Namespace(**{**vars(args), "labels": "target_listwise", "tau": 0.0}))
    capsys.readouterr()
    k_u = _learn_data(config, params, checkpoint_tokenizer(teacher), problems[:1], 1, 0, 4, 32, unrotated=True,
                      progress="learn: train problems")[0]  # minutes at learn's defaults: a bar on stderr
    assert "learn: train problems: 100%" in capsys.readouterr().err
    assert np.abs(np.asarray(k_u) - np.asarray(k[:1])).max() > 1e-2  # the keys' rotation is undone
    np.testing.assert_allclose(np.linalg.norm(np.asarray(k_u), axis=-1), np.linalg.norm(np.asarray(k[:1]), axis=-1),
                               rtol=1e-4)  # a rotation: same norms


def test_target_topk_labels_and_facts_in_topk_match_loops(rng):
    """learn's top-k labels are the k largest targets among the eligible tokens of each row, and
    facts_in_topk counts, per row, whether every fact is within the top k and how many binding values /
    other eligible tokens score above the lowest fact (medians over rows), by loops."""
    from eval.diagnose import facts_in_topk, target_topk_labels

    n, s, k = 5, 40, 6
    r = rng.normal(size=(n, s)).astype(np.float32)
    e = np.zeros((n, s), np.float32)
    e[:, 3:31] = 1
    labels = np.asarray(target_topk_labels(jnp.asarray(r), jnp.asarray(e), k))
    for i in range(n):
        want = set(3 + np.argsort(-r[i, 3:31])[:k])
        assert set(np.nonzero(labels[i])[0]) == want
    scores = rng.normal(size=(n, s)).astype(np.float32)
    y, m = np.zeros((n, s), bool), np.zeros((n, s), bool)
    for i in range(n):
        pos = rng.choice(np.arange(3, 31), size=12, replace=False)
        y[i, pos[:2]], m[i, pos] = True, True
    scores[0, np.nonzero(y[0])[0]] = 10.0  # row 0's facts are on top
    kept, values, others = facts_in_topk(scores, y, m, e, k)
    rows = []
    for i in range(n):
        elig = [t for t in range(s) if e[i, t]]
        top = sorted(elig, key=lambda t: -scores[i, t])[:k]
        low = min(scores[i, t] for t in elig if y[i, t])
        rows.append((all(t in top for t in elig if y[i, t]),
                     sum(scores[i, t] > low for t in elig if m[i, t] and not y[i, t]),
                     sum(scores[i, t] > low for t in elig if not m[i, t])))
    assert rows[0][0] and kept == np.mean([a for a, _, _ in rows])
    assert values == np.median([b for _, b, _ in rows]) and others == np.median([c for _, _, c in rows])


def test_shift_ranks_move_only_with_a_position_reading_scorer(rng):
    """`diagnose shift`: starting the positions elsewhere leaves project_qkv's values (every hidden
    state) unchanged and only rotates the keys, so the facts' ranks stay put for a scorer of
    unrotated keys and move for one of the cached, rotated keys (random scorer weights)."""
    import dataclasses

    from flax import traverse_util

    from eval.diagnose import fact_ranks
    from kvpop_jax import KVpopConfig
    from kvpop_jax.modeling import retrofit_params

    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    ids = [int(x) for x in rng.integers(0, base.vocab_size, size=60)]
    _, _, v0 = layer_qkv(base, init_params(base, jax.random.key(4)), jnp.asarray([ids]), 1)
    _, _, v9 = layer_qkv(base, init_params(base, jax.random.key(4)), jnp.asarray([ids]), 1, offset=900)
    np.testing.assert_allclose(np.asarray(v0), np.asarray(v9), atol=2e-4, rtol=0)
    moved = {}
    for keys in ("rotated", "unrotated"):
        config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=10, scorer="mlstm",
                                                             mlstm_chunk=8, scorer_keys=keys))
        params = retrofit_params(config, init_params(base, jax.random.key(4)), jax.random.key(1))
        flat = traverse_util.flatten_dict(params, sep="/")
        flat = {k: jnp.asarray(np.random.default_rng(7).normal(size=v.shape).astype(np.float32))
                if "/kvpop/scorer/" in k else v for k, v in flat.items()}
        params = traverse_util.unflatten_dict(flat, sep="/")
        needed = [10, 20, 30, 40]
        ranks = [fact_ranks(config, params, ids, needed, 1, 0, offset) for offset in (0, 500, 1000)]
        assert all(0 <= r <= 60 for rs in ranks for r in rs)
        moved[keys] = ranks[1:] != ranks[:1] * 2
    assert moved == {"rotated": True, "unrotated": False}


@pytest.mark.long
def test_margin_and_shift_print_on_the_shipped_export(capsys):
    """`diagnose margin` and `shift` run on the shipped KVpop export: the margins over the 1st, 10th,
    30th, k-th and 200th other token can only grow down the list (the others are sorted), the exact
    target's margin over the 200th is positive (a fact is read again and again), and shift prints
    one line per offset with the offset-0 rank of `fact_ranks`."""
    import argparse

    from eval.diagnose import margin, shift

    args = argparse.Namespace(exports=["checkpoints/demo-kvpop-mlstm"], problems=1, seed=0, task="reuse",
                              prompt_len=1024, budget=123, layer=1, kv_head=0, offsets=[512, 0, 512])
    margin(args)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["sparse", "dense"]
    for line in lines:
        gaps = [float(x) for x in line.split("[")[-1].rstrip("]").split(",")]
        assert len(gaps) == 5 and gaps == sorted(gaps)
    assert gaps[-1] > 0
    shift(args)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out[1:]] == ["0:", "512:"]  # each offset once (0 is always measured)


def test_exact_log_target_equals_the_library_dense_normalizer_target(rng):
    """diagnose's numpy target (`exact_log_target`, used by reads and learn) and kvpop_jax's transposed-
    attention target with the dense normalizer (the model's aux, max aggregation, count normalized)
    are the same numbers, per KV head: log(m + eps) from the library, log(m) here (random model)."""
    import dataclasses

    from eval.diagnose import exact_log_target
    from kvpop_jax.modeling import dense_attention_probs
    from eval.recall import policy_arrays
    from kvpop_jax import KVpopConfig
    from kvpop_jax.modeling import retrofit_params

    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    kv = KVpopConfig(sinks=2, window=4, topk=6, scorer="mlp", normalizer="dense")
    config = dataclasses.replace(base, kvpop=kv)
    params = retrofit_params(config, init_params(base, jax.random.key(4)), jax.random.key(1))
    s = 40
    ids = jnp.asarray(rng.integers(0, base.vocab_size, size=(1, s)))
    lib = np.asarray(policy_arrays(Qwen3ForCausalLM(config), params, ids, jnp.asarray([[s - 1]]))["target"])
    g = config.num_attention_heads // config.num_key_value_heads
    assert g > 1
    for layer in range(config.num_hidden_layers):
        probs = np.asarray(dense_attention_probs(config, params, ids, layer))
        for h in range(config.num_key_value_heads):  # group_probs' slice: KV head h's query heads
            mine = np.exp(exact_log_target(probs[:, h * g:(h + 1) * g], kv.window)[0, : s - kv.window])
            theirs = np.exp(lib[layer, 0, h, : s - kv.window]) - kv.eps
            np.testing.assert_allclose(theirs, mine, rtol=1e-4, atol=1e-7)


def test_reads_kinds_partition_the_eligible_tokens_and_shares_match_a_brute_force(rng, capsys):
    """`diagnose reads`: token_kinds splits exactly the positions eligible at the last prompt token,
    the facts by their meta, a binding value by whether its name comes again; name_read_share is the
    attention from the name's later occurrences over all of a token's future attention; the run prints
    one row per kind."""
    import argparse

    from demo.task import generate_dataset
    from eval.diagnose import KINDS, name_read_share, reads, token_kinds
    from kvpop_jax.checkpoint import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer("checkpoints/demo-teacher")
    ex = generate_dataset(1, 3, "test", task="reuse", seq_len=1024)[0]
    n = ex["meta"]["n_prompt_tokens"]
    tokens = [tokenizer.decode([i]) for i in tokenizer(ex["text"])["input_ids"][:n]]
    kinds = token_kinds(ex, tokens, sinks=4, window=32)
    flat = sorted(t for positions in kinds.values() for t in positions)
    assert flat == list(range(4, n - 32)) and list(kinds) == list(KINDS)
    assert {f["value_pos"] for f in ex["meta"]["facts"] if f["queried"]} == set(kinds["queried fact"])
    for t in kinds["binding value, name recurs"][:20] + kinds["binding value, name does not"][:20]:
        recurs = any(tokens[d] == tokens[t - 1] for d in range(t + 1, n))
        assert recurs == (t in kinds["binding value, name recurs"])
    assert all(tokens[t] == "\n" for t in kinds["newline"]) and kinds["binding value, name recurs"] and kinds["newline"]

    s = 40
    toks = [str(x) for x in rng.integers(0, 5, size=s)]
    probs = rng.random((2, s, s))
    t, w = 7, 4
    brute = sum(probs[h, d, t] for h in range(2) for d in range(t + w, s)
                if toks[d] == toks[t - 1] or toks[d - 1] == toks[t - 1])
    total = probs[:, t + w:, t].sum()
    np.testing.assert_allclose(name_read_share(probs, toks, t, w), brute / total, rtol=1e-6)

    reads(argparse.Namespace(teacher="checkpoints/demo-teacher", problems=1, seed=0, task="reuse", prompt_len=1024,
                             budget=106, sinks=4, window=32, layer=1, kv_head=0))
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row[2:32].strip() for row in rows] == list(KINDS)


def test_parks_names_each_lookup_by_its_meta_and_shares_match_a_brute_force(rng, capsys):
    """`diagnose parks`: name_kind tells a binding, a scratch restatement, a keep mark, a recall, the
    question and the completion apart as the task's meta places them; park_shares splits a query's
    attention into first token / window / older digits / older other (summing to 1) as loops do; on
    the shipped teacher a completion's and a recall's lookup land on one older key (the fact) and the names no lookup serves
    (bindings) park on the first token or the window."""
    import argparse

    from demo.task import generate_dataset
    from eval.diagnose import NAME_KINDS, name_kind, park_shares, parks
    from kvpop_jax.checkpoint import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer("checkpoints/demo-teacher")
    ex = generate_dataset(1, 4, "test", task="reuse", seq_len=1024)[0]
    n, meta = ex["meta"]["n_prompt_tokens"], ex["meta"]
    tokens = [tokenizer.decode([i]) for i in tokenizer(ex["text"])["input_ids"]]
    kinds = {d: name_kind(tokens, d, n) for d in range(1, len(tokens))}
    facts = meta["facts"]
    assert {d for d, k in kinds.items() if k == "recall"} == {p - 1 for f in facts for p in f["reuse_pos"]}
    assert {d for d, k in kinds.items() if k == "keep mark"} == {f["mark_pos"] for f in facts}
    binds = {p - 1 for p in meta["binding_value_positions"]}
    recalled = {p for f in facts for p in f["reuse_pos"]}
    determined = [p for p in meta["determined_positions"] if p < n and p not in recalled]
    scratch = {p - 1 for p in determined[::2]}  # a scratch line's restated value, then its result
    assert {d for d, k in kinds.items() if k == "binding"} == binds - scratch
    assert {d for d, k in kinds.items() if k == "scratch restatement"} == scratch
    assert len([d for d, k in kinds.items() if k == "question"]) == 2
    queried = sum(f["queried"] for f in facts)  # the completion opens with `>name digit` per queried fact
    assert {d for d, k in kinds.items() if k == "completion"} == {n + 1 + 3 * i for i in range(queried)}

    s, w, d = 40, 6, 33
    toks = [str(x) if x < 10 else "a" for x in rng.integers(0, 14, size=s)]
    probs = rng.random((s, s))
    probs /= probs.sum(1, keepdims=True)
    got = park_shares(probs, np.isin(toks, list("0123456789")), d, w)
    old = range(1, d - w + 1)
    brute = [probs[d, 0], sum(probs[d, t] for t in range(d - w + 1, d + 1)),
             sum(probs[d, t] for t in old if toks[t] != "a"), sum(probs[d, t] for t in old if toks[t] == "a"),
             max(probs[d, t] for t in old)]
    np.testing.assert_allclose(got, brute, rtol=1e-6)
    np.testing.assert_allclose(probs[d, : d + 1].sum(), got[:4].sum(), rtol=1e-6)

    parks(argparse.Namespace(teacher="checkpoints/demo-teacher", problems=1, seed=4, task="reuse", prompt_len=1024,
                             window=32, layer=1, kv_head=0))
    rows = [row.split() for row in capsys.readouterr().out.splitlines()[2:]]
    assert [" ".join(r[:-7]) for r in rows[::2]] == list(NAME_KINDS)
    for r in rows:
        np.testing.assert_allclose(sum(float(x) for x in r[-5:-1]), 1.0, atol=2e-3)
    for kind in ("completion", "recall"):  # the match head reads the fact at the question and at each recall
        lookup = next(r for r in rows if r[0] == kind and r[2] == "0")
        assert float(lookup[-1]) > 0.9, lookup
    for r in rows:  # and the shipped teacher parks the names that no lookup serves (tiny_teacher_park*.flags)
        if r[0] == "binding":
            assert float(r[-4]) + float(r[-5]) > 0.9, r  # first token + window


def test_bad_arguments_are_refused_by_name_before_anything_loads(monkeypatch):
    """What used to print nonsense (a budget with k < 1 counted every fact as kept), wrap around
    (--layer -1) or end in a KeyError / ZeroDivisionError is refused by name, from config.json alone."""
    from eval import diagnose

    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(diagnose, "load_pretrained", no_load)
    base = ["--teacher", "checkpoints/demo-teacher", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "reuse"]
    for argv, message in (
        (["maxtgt", "--budget", "20"], r"--budget 20 leaves no long-range slot: maxtgt measures k = B - s - w = "
                                       r"20 - 4 - 32"),
        (["reads", "--budget", "-5"], "--budget -5 leaves no long-range slot"),
        (["keep", "--budget", "20"], r"budget 20 < s \+ w"),
        (["maxtgt", "--layer", "5"], r"--layer 5 is out of range: 'checkpoints/demo-teacher' has layers 0..1"),
        (["margin", "--layer", "-1"], "--layer -1 is out of range"),
        (["learn", "--kv_head", "2"], r"--kv_head 2 is out of range: .* has KV heads 0..1"),
        (["reads", "--problems", "0"], "--problems must be >= 1, got 0"),
        (["learn", "--steps", "-3"], "--steps must be >= 0, got -3"),
        (["shift", "--offsets", "-5000"], "--offsets must be >= 0"),
        (["shift", "--offsets", "abc"], "--offsets must be comma-separated integers"),
        (["shift", "--offsets", "512,2147483600"],  # the positions wrapped to negative ones in silence
         r"--offsets 2147483600 puts the last of a 1024-token prompt past the int32 positions \(2\*\*31 - 1\); "
         "want offsets <= 2147482624"),
        (["reads", "--prompt_len", "300"], "--prompt_len 300 is too short for reuse: the shortest is 959"),
        (["keep", "--exports", "checkpoints/demo-teacher"], r"'checkpoints/demo-teacher' is a dense checkpoint"),
        (["noise", "--sigmas", "-1"], r"--sigmas must be finite and >= 0 \(noise in nats\), got \[-1.0\]"),
        (["noise", "--sigmas", "inf"], "--sigmas must be finite and >= 0"),
        (["noise", "--older_first", "-0.1"], r"--older_first must be finite and >= 0 \(nats per token\), got -0.1"),
        (["noise", "--sigmas", "abc"], "--sigmas must be comma-separated numbers, got 'abc'"),
        (["noise", "--budget", "53"], r"--budget 53 leaves no long-range slot in 'checkpoints/demo-kvpop-mlstm' \(k = 0\)"),
        (["ceiling", "--budget", "53"], r"--budget 53 leaves no long-range slot .* ceiling measures"),
        (["margin", "--budget", "53"], r"--budget 53 leaves no long-range slot .* margin measures the facts' margin "
                                       "over the k-th"),  # its k-th column was the last (others[-1]) in silence
        (["ceiling", "--futures", "0"], "--futures must be >= 1, got 0"),
        (["ceiling", "--cut_step", "0"], "--cut_step must be >= 1, got 0"),
        (["ceiling", "--cut_step", "1000"], r"--cut_step 1000 draws no future: after the first cut \(token 37 of "
                                            r"'checkpoints/demo-kvpop-mlstm'\) .* want --cut_step < 987"),  # was 0.998
    ):
        with pytest.raises(ValueError, match=message):
            diagnose.main(base + argv)  # argparse: the later --exports wins


def test_noise_recall_is_one_without_noise_falls_with_it_and_matches_run_recall(rng, tmp_path, capsys):
    """`diagnose noise`: the teacher against itself recalls every kept token at sigma 0 and fewer under
    heavy noise; the export's own column is `eval.recall.run_recall`'s recall on the same rows and
    queries (random retrofitted model, fresh random tokens)."""
    import dataclasses

    from eval.diagnose import noise_recall
    from eval.recall import run_recall
    from kvpop_jax import KVpopConfig
    from kvpop_jax.modeling import retrofit_params

    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=6, scorer="mlp", normalizer="dense"))
    params = retrofit_params(config, init_params(base, jax.random.key(7)), jax.random.key(8))
    ids = rng.integers(0, base.vocab_size, size=(3, 60)).astype(np.int32)
    student, perturbed, position = noise_recall(config, params, ids, [0.0, 0.3, 50.0], seed=3, num_queries=8)
    assert position == {}  # older_first = 0: no probes
    np.testing.assert_array_equal(perturbed[0.0], 1.0)
    assert perturbed[50.0].mean() < perturbed[0.3].mean() <= 1.0
    reference = run_recall((config, params), ids, num_queries=8, seed=3, out_dir=str(tmp_path), progress=False)
    np.testing.assert_allclose(student, reference.recall)
    assert 0.0 < student.mean() < 1.0
    # The probes: a policy that keeps the oldest tokens keeps exactly s..s+k-1 at every saturated query
    # (brute force), and a vanishing older-first term leaves the export's recall as it is.
    s_, w, k = 2, 4, 6
    student2, _, position = noise_recall(config, params, ids, [], seed=3, num_queries=8, older_first=1e-9,
                                         progress=True)  # `diagnose noise` shows its minutes over the prompts
    err = capsys.readouterr().err
    assert "noise: 100%" in err and "3/3" in err
    np.testing.assert_allclose(student2, student)
    np.testing.assert_allclose(position["export + older first"], student, atol=1e-12)
    from eval.recall import policy_arrays, sample_saturated_queries
    from kvpop_jax.kvpop import kept_long_range
    q_idx = sample_saturated_queries(np.random.default_rng(3), 3, seq_len=60, budget=s_ + w + k, num=8)
    hits = np.zeros((config.num_hidden_layers, config.num_key_value_heads))
    tot = np.zeros_like(hits)
    for row in range(3):
        q = jnp.asarray(q_idx[row: row + 1])
        arr = policy_arrays(Qwen3ForCausalLM(config), params, jnp.asarray(ids[row: row + 1]), q)
        for layer in range(config.num_hidden_layers):
            teacher = np.asarray(kept_long_range(arr["teacher_ranks"][layer], arr["teacher_cutoffs"][layer], q,
                                                 sinks=s_, window=w))[0]  # [H, Nq, S]
            hits[layer] += teacher[:, :, s_: s_ + k].sum((1, 2))
            tot[layer] += teacher.sum((1, 2))
    np.testing.assert_allclose(position["oldest first"], hits / tot)


def test_ceiling_recall_is_one_when_the_future_is_known_and_falls_when_it_is_drawn(rng, tmp_path):
    """`diagnose ceiling` (random retrofitted model, fresh random tokens): with draws that are the row
    itself the mean log-target is the target, so the policy recalls every teacher token; with a
    random future after each cut it recalls fewer, and more with the future known from a later cut;
    the export's column is `run_recall`'s; a draw that changes the past is refused. Brute force: the
    score of token t at cut_step 7 is the mean over the draws at the first cut c >= t + w + 1, which
    is also `conditional_log_target`'s."""
    import dataclasses

    from eval.diagnose import ceiling_recall
    from eval.recall import run_recall
    from kvpop_jax import KVpopConfig
    from kvpop_jax.modeling import retrofit_params

    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=2, window=4, topk=6, scorer="mlp", normalizer="dense"))
    params = retrofit_params(config, init_params(base, jax.random.key(7)), jax.random.key(8))
    ids = rng.integers(0, base.vocab_size, size=(3, 60)).astype(np.int32)
    known = lambda row, c, j: ids[row]  # noqa: E731
    export, conditional = ceiling_recall(config, params, ids, known, futures=2, cut_step=5, seed=3, num_queries=8)
    np.testing.assert_array_equal(conditional, 1.0)
    reference = run_recall((config, params), ids, num_queries=8, seed=3, out_dir=str(tmp_path), progress=False)
    np.testing.assert_allclose(export, reference.recall)

    def random_future(row, c, j):
        out = ids[row].copy()
        out[c:] = np.random.default_rng([row, c, j]).integers(0, base.vocab_size, size=60 - c)
        return out

    _, drawn = ceiling_recall(config, params, ids, random_future, futures=4, cut_step=7, seed=3, num_queries=8)
    assert drawn.mean() < 0.95
    _, coarse = ceiling_recall(config, params, ids, random_future, futures=4, cut_step=30, seed=3, num_queries=8)
    assert coarse.mean() > drawn.mean()  # the future known further past leave time
    with pytest.raises(ValueError, match=r"must return 60 tokens starting with the row's first"):
        ceiling_recall(config, params, ids, lambda row, c, j: ids[(row + 1) % 3], futures=1, cut_step=20, seed=3)
    with pytest.raises(ValueError, match=r"must return 60 tokens"):
        ceiling_recall(config, params, ids, lambda row, c, j: ids[row, :59 - j], futures=2, cut_step=20, seed=3)

    # brute force of the drawn policy's scores, row 0, through the same recall counting
    from eval.recall import policy_arrays, recall_counts, sample_saturated_queries
    from kvpop_jax.policy import ranks_from_priority, running_topk_cutoff, static_priority
    kv, model = config.kvpop, Qwen3ForCausalLM(config)
    q = jnp.asarray(sample_saturated_queries(np.random.default_rng(3), 3, seq_len=60, budget=kv.budget, num=8)[:1])
    arr = policy_arrays(model, params, jnp.asarray(ids[:1]), q)
    score = np.zeros((config.num_hidden_layers, config.num_key_value_heads, 60), np.float32)
    for t in range(60 - kv.window):
        c = next(c for c in (7, 14, 21, 28, 35, 42, 49, 56, 60) if c >= t + kv.window + 1)
        draws = np.stack([random_future(0, c, j) for j in range(4)])
        tg = np.asarray(policy_arrays(model, params, jnp.asarray(draws), jnp.repeat(q, 4, 0))["target"])
        score[:, :, t] = tg[:, :, :, t].mean(1)
    from eval.diagnose import conditional_log_target
    direct = conditional_log_target(config, params, ids[0], lambda c, j: random_future(0, c, j), futures=4, cut_step=7)
    np.testing.assert_allclose(direct[:, 0], score, rtol=1e-5, atol=1e-5)  # what the training probe fits
    chunked = conditional_log_target(config, params, ids[0], lambda c, j: random_future(0, c, j), futures=4,
                                     cut_step=7, per_forward=3)  # draws 3 + 1 per forward: memory, not the mean
    np.testing.assert_allclose(chunked[:, 0], score, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"a row of 6 tokens has none that leaves the window: need more than"):
        conditional_log_target(config, params, ids[0, :6], lambda c, j: ids[0, :6], futures=1, cut_step=1)
    ranks = jnp.stack([ranks_from_priority(static_priority(jnp.asarray(score[layer][None]), arr["log_gamma"][layer]))
                       for layer in range(config.num_hidden_layers)])
    cutoffs = jnp.stack([running_topk_cutoff(r, sinks=kv.sinks, window=kv.window, topk=kv.topk) for r in ranks])
    h, tot = recall_counts(ranks, cutoffs, arr["teacher_ranks"], arr["teacher_cutoffs"], q, sinks=kv.sinks,
                           window=kv.window)
    _, row0 = ceiling_recall(config, params, ids[:1], random_future, futures=4, cut_step=7, seed=3, num_queries=8)
    np.testing.assert_allclose(row0, np.asarray(h)[:, 0] / np.maximum(np.asarray(tot)[:, 0], 1))


def test_explained_share_equals_a_loop_over_groups(rng):
    from eval.diagnose import explained_share

    y = rng.normal(size=200)
    groups = list(rng.integers(0, 7, size=200))
    pred = np.array([np.mean([v for v, h in zip(y, groups) if h == g]) for g in groups])
    np.testing.assert_allclose(explained_share(y, groups), 1 - np.var(y - pred) / np.var(y), rtol=1e-12)
    assert explained_share(y, list(range(200))) == pytest.approx(1.0)  # every value its own group
    assert explained_share(y, [0] * 200) == pytest.approx(0.0, abs=1e-12)  # one group: the mean


def test_target_structure_and_rank_correlation(rng):
    """`diagnose noise`'s second table on a random retrofitted model with no sinks (the previous token
    of the first counted one exists): one row per layer / KV head with finite shares in [0, 1], and
    Spearman's rho equal to scipy's on fresh random values."""
    import dataclasses

    from scipy.stats import spearmanr

    from eval.diagnose import rank_correlation, target_structure
    from kvpop_jax import KVpopConfig
    from kvpop_jax.modeling import retrofit_params

    a, b = rng.normal(size=300), rng.normal(size=300)
    b = a + b  # correlated
    np.testing.assert_allclose(rank_correlation(a, b), spearmanr(a, b).statistic, rtol=1e-10)
    base = Qwen3Config(**TINY_HF_CONFIGS["g2_untied"])
    config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=0, window=4, topk=6, scorer="mlp", normalizer="dense"))
    params = retrofit_params(config, init_params(base, jax.random.key(3)), jax.random.key(5))
    rows = target_structure(config, params, rng.integers(0, base.vocab_size, size=(2, 48)).astype(np.int32),
                            min_future=8)
    assert [(r["layer"], r["kv_head"]) for r in rows] == [(i, h) for i in range(config.num_hidden_layers)
                                                        for h in range(config.num_key_value_heads)]
    for r in rows:
        assert r["sd"] > 0 and -1 <= r["corr"] <= 1 and -1 <= r["corr_position"] <= 1
        for key in ("token", "pair", "position", "token_position"):
            assert -1e-9 <= r[key] <= 1 + 1e-9, (key, r)


def test_out_appends_the_printed_table_with_its_command(monkeypatch, tmp_path, capsys):
    """--out FILE: the table still prints, and lands in FILE under a dated heading with the command;
    a second run appends (a results file is never truncated)."""
    from eval import diagnose

    monkeypatch.setitem(diagnose.DIAGNOSTICS, "keep", lambda args: print(f"layer  share\nL0     {args.problems / 8}"))
    out = tmp_path / "results.md"
    out.write_text("# mine\n\nearlier\n")
    argv = ["keep", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "reuse", "--problems", "3"]
    diagnose.main(argv + ["--out", str(out)])
    diagnose.main(argv + ["--problems", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "L0     0.375" in printed and f"appended to {out}" in printed
    text = out.read_text()
    assert text.startswith("# mine\n\nearlier\n") and text.count("## diagnose keep, ") == 2
    assert "- command: `python -m eval.main diagnose keep --exports checkpoints/demo-kvpop-mlstm" in text
    assert "```\nlayer  share\nL0     0.375\n```" in text and "L0     0.5\n```" in text


def test_out_is_checked_before_the_diagnostic_and_a_last_line_keeps_its_own(monkeypatch, tmp_path, capsys):
    """A bad --out is refused before minutes of measuring; a file whose last line has no newline
    gets one before the new heading (which would otherwise not render)."""
    from eval import diagnose
    from eval.main import main as eval_main

    ran = []
    monkeypatch.setitem(diagnose.DIAGNOSTICS, "keep", lambda args: ran.append(1) or print("L0  0.5"))
    argv = ["diagnose", "keep", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "reuse"]
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path, "is a folder, not a file"), (tmp_path / "file" / "r.md", "lies under the file")):
        with pytest.raises(SystemExit) as e:
            eval_main(argv + ["--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: --out={out}" in err and message in err
    assert not ran
    out = tmp_path / "notes.md"
    out.write_text("# mine\n\nlast line")
    eval_main(argv + ["--out", str(out)])
    assert ran and out.read_text().startswith("# mine\n\nlast line\n\n## diagnose keep, ")


def test_out_that_is_not_markdown_is_refused_and_left_as_it_was(monkeypatch, tmp_path, capsys):
    """--out appends markdown sections: pointed at a checkpoint's config.json (or any non-.md file) it
    used to append a section there, and the checkpoint no longer loaded. Refused by name, untouched."""
    from eval import diagnose
    from eval.main import main as eval_main

    ran = []
    monkeypatch.setitem(diagnose.DIAGNOSTICS, "keep", lambda args: ran.append(1) or print("L0  0.5"))
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "qwen3"}\n')
    for out in (config, tmp_path / "new.txt"):
        with pytest.raises(SystemExit) as e:
            eval_main(["diagnose", "keep", "--exports", "checkpoints/demo-kvpop-mlstm", "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: --out={out} is not a markdown file" in err and ".md" in err
    assert not ran and config.read_text() == '{"model_type": "qwen3"}\n' and not (tmp_path / "new.txt").exists()


def test_sinks_window_budget_and_label_k_that_leave_nothing_to_measure_are_refused(monkeypatch):
    """What used to print 0.0 / nan (no eligible token), end in a numpy or IndexError message (probe
    --window 0, learn with k above the eligible tokens) or silently label the wrong tokens (learn
    --label_k -3: the sort's 3rd smallest; a k past the row: jnp clamps the index) is refused by name."""
    from eval import diagnose

    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(diagnose, "load_pretrained", no_load)
    base = ["--task", "read_once", "--prompt_len", "115"]
    for argv, message in (
        (["maxtgt", "--window", "2000", "--budget", "3000"],
         r"--sinks 4 \+ --window 2000 leave no token eligible at the last of a 115-token prompt"),
        (["probe", "--sinks", "2000"], r"want s \+ w < 115"),
        (["reads", "--sinks", "100", "--window", "15", "--budget", "200"], "leave no token eligible"),
        (["probe", "--window", "0"], "--window 0 leaves probe nothing to match"),
        (["parks", "--window", "100000"], r"--window 100000 covers the whole 115-token prompt: parks splits"),
        (["maxtgt", "--budget", "115"], r"--budget 115 keeps every token of a 115-token prompt \(--prompt_len\): "
                                        "nothing would be evicted"),  # every fact 'kept': 1.0
        (["keep", "--exports", "checkpoints/demo-kvpop-mlstm", "--budget", "140"],
         r"--budget 140 keeps every token of a 115-token prompt in 'checkpoints/demo-kvpop-mlstm' \(s \+ w \+ k = "
         r"123 slots\): nothing would be evicted; want --budget below 132"),
        (["noise", "--exports", "checkpoints/demo-kvpop-mlstm", "--budget", "140"], "nothing would be evicted"),
        (["ceiling", "--exports", "checkpoints/demo-kvpop-mlstm", "--budget", "10"],  # was "budget 10 < ...": no flag
         r"^--budget 10 < s \+ w \+ scorer state = 4 \+ 32 \+ 17 of the checkpoint \('checkpoints/demo-kvpop-mlstm'\)"),
        (["learn", "--budget", "2000"], r"--budget 2000 exceeds the 115-token prompt: .* of the 79 eligible tokens"),
        (["learn", "--budget", "100", "--labels", "target_topk", "--label_k", "-3"],
         r"--label_k -3 is out of range: .* want 0 .* to 79"),
        (["learn", "--budget", "100", "--labels", "target_topk", "--label_k", "80"], "--label_k 80 is out of range"),
    ):
        with pytest.raises(ValueError, match=message):
            diagnose.main(base + argv)


def test_a_retrofitted_export_as_the_teacher_is_refused(monkeypatch):
    """The teacher diagnostics read the dense teacher's attention; a KVpop export's base weights differ
    from its teacher's (fine-tuned in the retrofit), so `--teacher EXPORT` used to diagnose the student
    under the teacher's name. Refused, as a dense checkpoint given to --exports is."""
    from eval import diagnose

    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(diagnose, "load_pretrained", no_load)
    for what in diagnose.TEACHER_DIAGNOSTICS:
        with pytest.raises(ValueError, match=rf"diagnose {what} reads the dense teacher's attention; "
                                             r"'checkpoints/demo-kvpop-mlstm' is a KVpop export \(--teacher\)"):
            diagnose.main([what, "--teacher", "checkpoints/demo-kvpop-mlstm", "--task", "reuse"])


def test_positions_past_max_position_embeddings_are_warned_of(monkeypatch, capsys):
    """eval accuracy and recall warn when rows run past max_position_embeddings (4096 here); diagnose
    ran there in silence (--prompt_len 5000, or shift's --offsets 4000)."""
    from eval import diagnose

    monkeypatch.setitem(diagnose.DIAGNOSTICS, "shift", lambda args: None)
    monkeypatch.setitem(diagnose.DIAGNOSTICS, "maxtgt", lambda args: None)
    diagnose.main(["shift", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "reuse", "--offsets", "512,4000"])
    err = capsys.readouterr().err
    assert ("warning: --prompt_len 1024 plus the largest --offsets reaches position 5024, beyond the "
            "max_position_embeddings 4096 of 'checkpoints/demo-kvpop-mlstm'") in err
    diagnose.main(["maxtgt", "--task", "reuse", "--prompt_len", "5000"])
    assert "warning: --prompt_len 5000 reaches position 5000" in capsys.readouterr().err
    diagnose.main(["maxtgt", "--task", "reuse"])
    assert "warning" not in capsys.readouterr().err


def test_target_and_margin_say_which_export_they_read(monkeypatch, capsys):
    """target and margin read the first of --exports; the others were dropped in silence (and target's
    table named no export at all)."""
    from eval import diagnose

    monkeypatch.setitem(diagnose.DIAGNOSTICS, "margin", lambda args: None)
    two = "checkpoints/demo-kvpop-mlstm,checkpoints/demo-kvpop-mlstm/"
    diagnose.main(["margin", "--exports", two, "--task", "reuse"])
    assert ("warning: diagnose margin reads the first of the 2 --exports, 'checkpoints/demo-kvpop-mlstm'; not "
            "measured: 'checkpoints/demo-kvpop-mlstm/'") in capsys.readouterr().err
    diagnose.main(["margin", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "reuse"])
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(diagnose, "_kept_shares", lambda *args: (None, np.zeros((2, 2)), np.zeros((2, 2))))
    monkeypatch.setattr(diagnose, "_problems", lambda args: [])
    diagnose.main(["target", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "reuse", "--problems", "2"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("checkpoints/demo-kvpop-mlstm at B 123: per target setting") and len(out) == 9


def test_a_checkpoint_without_the_demo_tokenizer_is_refused(monkeypatch, tmp_path):
    """Without tokenizer files every diagnostic ended in "TypeError: 'NoneType' object is not callable";
    another tokenizer would put the problems' fact positions on other tokens in silence."""
    import shutil

    from eval import diagnose

    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model before checking the arguments")

    monkeypatch.setattr(diagnose, "load_pretrained", no_load)
    bare = tmp_path / "bare"
    shutil.copytree("checkpoints/demo-kvpop-mlstm", bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(ValueError, match=f"'{bare}' ships no tokenizer: diagnose tokenizes the demo problems"):
        diagnose.main(["keep", "--exports", str(bare), "--task", "reuse"])
    other = tmp_path / "other"
    shutil.copytree("checkpoints/demo-teacher", other)
    tok = (other / "tokenizer.json").read_text()
    (other / "tokenizer.json").write_text(tok.replace('"keep"', '"kept"', 1))
    with pytest.raises(ValueError, match="has a tokenizer other than the demo's"):
        diagnose.main(["parks", "--teacher", str(other), "--task", "reuse"])


def test_shift_still_runs_at_a_budget_above_the_prompt(monkeypatch):
    """shift's ranks do not depend on the budget (only its 'within k' share): not refused like keep."""
    from eval import diagnose

    ran = []
    monkeypatch.setitem(diagnose.DIAGNOSTICS, "shift", lambda args: ran.append(1))
    diagnose.main(["shift", "--exports", "checkpoints/demo-kvpop-mlstm", "--task", "read_once", "--prompt_len", "115"])
    assert ran


def test_rank_and_probe_skip_problems_without_a_pair_instead_of_printing_nan(monkeypatch, capsys):
    """A problem with no eligible queried fact (or no other eligible binding) has no AUC: `rank` averaged
    its nan into every head's line, and `probe` crashed on a fact inside the window ("all input arrays must
    have the same shape"). Both now skip it and say so; the others' AUC is what they alone give. Facts inside
    the window at the last prompt token are not compared (they are protected, not ranked)."""
    import copy

    from demo.task import generate_dataset
    from eval import diagnose

    problems = generate_dataset(3, 0, "test", task="read_once", seq_len=115)
    for ex in problems:  # the pairs are the eligible facts and other binding values, by brute force
        last = ex["meta"]["n_prompt_tokens"] - 1
        needed, others = diagnose._fact_pairs(ex, 4, 32)
        facts = {f["value_pos"] for f in ex["meta"]["facts"] if f["queried"]}
        assert needed == sorted(p for p in facts if 4 <= p <= last - 32)
        assert set(others) == {p for p in ex["meta"]["binding_value_positions"] if 4 <= p <= last - 32} - facts
    bare = copy.deepcopy(problems[1])
    for f in bare["meta"]["facts"]:
        f["queried"] = False
    lines = {}
    for name, command in (("rank", ["rank", "--exports", "checkpoints/demo-kvpop-mlstm"]), ("probe", ["probe"])):
        for key, given in (("alone", [problems[0]]), ("with", [problems[0], bare])):
            monkeypatch.setattr(diagnose, "_problems", lambda args, given=given: given)
            diagnose.main([*command, "--task", "read_once", "--prompt_len", "115"])
            lines[name, key] = capsys.readouterr().out.splitlines()
        alone, both = lines[name, "alone"], lines[name, "with"]
        assert "(1 read_once problems)" in both[0] and "(1 problems skipped" in both[1], both
        assert both[2:] == alone[1:] and "nan" not in " ".join(both), (alone, both)
