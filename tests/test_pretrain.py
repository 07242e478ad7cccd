"""train/demo_teacher/ (`python -m train.pretrain`): the demo teacher's trainer (batches, loss goes
down, checkpoint, resume, export) and the teacher shipped in checkpoints/demo-teacher/."""

import dataclasses
import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from demo import atoms
from demo import task as demo_task
from kvpop_jax import load_pretrained
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import Qwen3ForCausalLM
from train.demo_teacher.config import PretrainConfig
from train.demo_teacher.data import (BOS_ID, EOS_ID, VOCAB, Phase, decode, drill_row, encode, lookup_row,
                                     make_batch, parse_curriculum, recall_row)
from train.demo_teacher.evaluate import evaluate, export, model_card
from train.demo_teacher.init import DIGIT_IDS, init_offset_heads, plant_lookup_circuit
from train.demo_teacher.loop import STATE_FILE, init_state, make_optimizer, train
from train.demo_teacher.main import config_from_flags, define_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = os.path.join(REPO, "checkpoints", "demo-teacher")


def tiny_config(tmp_path, steps=(12, 4), **overrides) -> PretrainConfig:
    model = Qwen3Config(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 rope_theta=10_000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                 attention_bias=True)
    values = dict(model=model, offset_heads=(1, 2), phases=(Phase(128, steps[0], 4), Phase(160, steps[1], 2)),
                  run_dir=str(tmp_path / "run"), out_dir=str(tmp_path / "out"), lr=1e-2, warmup_steps=4,
                  eval_every=0, checkpoint_every=4, log_every=2, final_eval_examples=2, eval_batch=2)
    values.update(overrides)
    return PretrainConfig(**values)


def test_curriculum_and_flagfile_parse():
    assert parse_curriculum("256:10:16, 1024:5", 8) == (Phase(256, 10, 16), Phase(1024, 5, 8))
    with pytest.raises(ValueError, match="LEN:STEPS"):
        parse_curriculum("256", 8)
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["pretrain", f"--flagfile={os.path.join(REPO, 'configs', 'tiny_teacher.flags')}"])
    cfg = config_from_flags(fv)
    assert cfg.model.num_key_value_heads < cfg.model.num_attention_heads  # GQA: KVpop works per KV head
    assert cfg.model.vocab_size == len(VOCAB) and cfg.model.tie_word_embeddings


def test_reuse_rows_too_long_for_a_phase_are_refused_before_training(tmp_path):
    # reuse traces need room for their marked facts: a 256-token phase with reuse rows used to fail
    # at its first step, minutes into a run; the config now names the phase and the reason up front.
    with pytest.raises(ValueError, match=r"reuse rows at 256 tokens: seq_len=256 is too short"):
        tiny_config(tmp_path, phases=(Phase(128, 2, 4), Phase(256, 2, 2, (("reuse", 0.5),))))
    tiny_config(tmp_path, phases=(Phase(1024, 2, 2, (("reuse", 0.5),)),))  # long enough: accepted
    tiny_config(tmp_path, phases=(Phase(256, 2, 2, (("reuse", 0.2),)),))  # round(0.2 * 2) = 0 reuse rows: accepted


def test_batches_are_whole_traces_with_completion_weights(tmp_path):
    cfg = tiny_config(tmp_path, completion_weight=3.0)
    batch = make_batch(cfg, 0)
    task = cfg.task(128)
    assert batch["input_ids"].shape == (4, 128 + task.completion_tokens)  # <bos> prompt completion <eos>, less one
    assert np.all(batch["input_ids"][:, 0] == BOS_ID) and np.all(batch["targets"][:, -1] == EOS_ID)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["input_ids"][:, 1:])
    assert np.all(batch["completion"].sum(-1) == task.completion_tokens + 1)
    np.testing.assert_array_equal(batch["weights"], np.where(batch["completion"], 3.0, 1.0))
    ex = demo_task.generate_example(demo_task.example_seed(0, "train", 1), config=task)  # row 1 of step 0
    assert decode(batch["input_ids"][1]) == ex["text"]
    assert make_batch(cfg, 12)["input_ids"].shape[0] == 2  # the second phase
    np.testing.assert_array_equal(make_batch(cfg, 3)["input_ids"], make_batch(cfg, 3)["input_ids"])


def test_drill_rows(tmp_path):
    ids, result = drill_row(np.random.default_rng(0), 40)
    assert len(ids) == 40 and ids[0] == BOS_ID
    for line in decode(ids).split("\n")[:-1]:  # complete lines: >a?b=c
        a, op, b, c = int(line[1]), line[2], int(line[3]), int(line[5])
        assert c == {"+": (a + b) % 10, "-": (a - b) % 10, "/": (a + b) // 2}[op], line
    assert [decode([i]) for i, r in zip(ids, result) if r] == [ln[5] for ln in decode(ids).split("\n") if len(ln) > 5]
    ids, weighted = lookup_row(np.random.default_rng(1), 80)
    text = decode(ids)
    bindings, *scratch = text.split(">")
    values = dict(zip(bindings.replace("\n", "")[::2], bindings.replace("\n", "")[1::2]))
    for line in scratch[:-1]:  # >name value op operand = result
        assert line[1] == values[line[0]] and int(line[5]) == (int(line[1]) + (1 if line[2] == "+" else -1) * int(line[3])) % 10
    assert [decode([i]) for i, w in zip(ids, weighted) if w][:4] == [scratch[0][1], scratch[0][5], scratch[1][1], scratch[1][5]]
    cfg = tiny_config(tmp_path, phases=parse_curriculum("128:2:4:drill=0.25/lookup=0.25/p_scratch=0.5", 4))
    batch = make_batch(cfg, 0)
    assert not batch["completion"][:2].any() and batch["completion"][2:].any(axis=-1).all()
    assert (batch["weights"][:2] == cfg.completion_weight).sum(-1).min() > 0
    assert decode(batch["input_ids"][1]).count(">") > 5  # the lookup drill row


def test_offset_heads_attend_back_at_init():
    from kvpop_jax.modeling import Attention, RMSNorm, init_params

    config = Qwen3Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True,
                         rope_theta=10_000.0, tie_word_embeddings=True)
    params = init_offset_heads(init_params(config, jax.random.key(0)), config, (1, 2))
    ids = jnp.asarray(np.random.default_rng(0).integers(4, len(VOCAB), size=(1, 40)))
    positions = jnp.arange(40)[None]
    layer = params["layers_0"]
    x = RMSNorm(config.rms_norm_eps).apply({"params": layer["input_layernorm"]}, params["embed_tokens"]["embedding"][ids])
    q, k, _ = Attention(config).apply({"params": layer["self_attn"]}, x, positions, method=Attention.project_qkv)
    logits = jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, 2, axis=2))[0]  # query head h reads KV head h // 2
    logits = jnp.where(jnp.tril(jnp.ones((40, 40), bool)), logits, -jnp.inf)
    probs = jax.nn.softmax(logits / np.sqrt(32), axis=-1)
    for head, offset in ((0, 1), (1, 1), (2, 2), (3, 2)):
        rows = np.arange(8, 40)
        assert np.all(np.argmax(probs[head, rows], -1) == rows - offset), head
        assert float(jnp.min(probs[head, rows, rows - offset])) > 0.8
    with pytest.raises(ValueError, match="attention_bias"):
        PretrainConfig(model=dataclasses.replace(config, attention_bias=False), phases=(Phase(128, 1, 1),),
                                run_dir="r", out_dir="o", offset_heads=(1, 2))


@pytest.mark.long
@pytest.mark.skipif(not os.path.isdir(TEACHER), reason="no shipped demo teacher")
def test_recall_accuracy_counts_the_recalled_values_a_model_predicts():
    """`recall_accuracy` against a per-problem loop over the recall lines (one forward per problem, no
    padding): the shipped teacher reads every recalled value, a random model about one in ten."""
    from kvpop_jax.modeling import init_params
    from train.demo_teacher.evaluate import recall_accuracy

    config, params = load_pretrained(TEACHER)
    model = Qwen3ForCausalLM(config)
    examples = demo_task.generate_dataset(3, 11, "test", task="reuse", seq_len=1024)
    for p, (lo, hi) in ((params, (0.95, 1.0)), (init_params(config, jax.random.key(5)), (0.0, 0.5))):
        got = recall_accuracy(model, p, examples, batch=2)  # a batch of 2 and one of 1
        hits = []
        for ex in examples:
            ids = encode(ex["text"])
            pred = np.asarray(model.apply({"params": p}, jnp.asarray([ids])).logits[0]).argmax(-1)
            hits += [pred[r - 1] == ids[r] for f in ex["meta"]["facts"] for r in f["reuse_pos"]]
        assert len(hits) == 27 and got == pytest.approx(np.mean(hits)) and lo <= got <= hi


@pytest.mark.long
@pytest.mark.parametrize("seed", [0, 1])
def test_planted_lookup_circuit_retrieves_digits_before_training(seed):
    from kvpop_jax.modeling import Qwen3ForCausalLM, init_params

    config = Qwen3Config(vocab_size=len(VOCAB), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True,
                         rope_theta=1e8, tie_word_embeddings=True)
    random = init_offset_heads(init_params(config, jax.random.key(seed)), config, (1, 2))
    planted = plant_lookup_circuit(random, config, seed)
    # A fresh lookup drill row (bindings, then `>name value ...` lines) and demo-task traces whose
    # completion looks up marked bindings hundreds of tokens back.
    ids, _ = lookup_row(np.random.default_rng((seed, 99)), 256)
    rows = [(np.asarray(ids), 0)]  # (ids, first position a lookup may sit at)
    task = demo_task.make_config("medium", seq_len=640)
    for i in range(4):
        ex = demo_task.generate_example((seed, 99, i), config=task)
        rows.append((np.asarray(encode(ex["text"])), ex["meta"]["n_prompt_tokens"]))
    model = Qwen3ForCausalLM(config)
    is_name = lambda x: np.isin(x, [VOCAB[n] for n in atoms.NAMES])  # noqa: E731
    for params, expect_all in ((planted, True), (random, False)):
        right = []
        for row, start in rows:
            pred = np.asarray(model.apply({"params": params}, jnp.asarray(row[None])).logits[0]).argmax(-1)
            lookup = is_name(row[:-1]) & np.isin(row[1:], DIGIT_IDS)  # name then digit ...
            lookup &= (np.roll(row, 1)[:-1] == VOCAB[">"]) if start == 0 else (np.arange(len(row) - 1) >= start)
            right += list(pred[:-1][lookup] == row[1:][lookup])  # ... read back: drill line or completion
        assert len(right) >= 12
        assert (np.mean(right) == 1.0) if expect_all else (np.mean(right) < 0.5), (expect_all, right)


@pytest.mark.long
def test_train_checkpoint_resume_export(tmp_path):
    cfg = tiny_config(tmp_path)
    state, records = train(cfg, progress=False)
    losses = [r["loss"] for r in records if "loss" in r]
    assert np.mean(losses[-2:]) < losses[0] - 0.5, losses
    assert int(state.step) == cfg.total_steps
    assert os.path.isfile(os.path.join(cfg.run_dir, STATE_FILE))

    # Interrupted at step 10 (saved there), then resumed: the same final weights.
    cut = tiny_config(tmp_path, run_dir=str(tmp_path / "run2"))
    partial, _ = train(cut, progress=False, stop_at=10)
    assert int(partial.step) == 10
    resumed, records2 = train(cut, progress=False)
    assert records2[0]["step"] == 12  # continued from the save at 10, not from 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), resumed.params, state.params)
    lr = json.loads(json.dumps(cut.lr))
    with pytest.raises(ValueError, match=rf"different settings: lr {lr} -> 0.005\. Rerun with the old values"):
        train(tiny_config(tmp_path, run_dir=cut.run_dir, lr=5e-3), progress=False)
    wider = dataclasses.replace(cut.model, hidden_size=cut.model.hidden_size * 2)
    with pytest.raises(ValueError, match=rf"model.hidden_size {cut.model.hidden_size} -> {wider.hidden_size}"):
        train(dataclasses.replace(cut, model=wider), progress=False)  # was "(model)" alone

    export(cfg, state.params, [evaluate(Qwen3ForCausalLM(cfg.model), state.params, cfg,
                                                          128, 2, split="test", batch=2)], "cmd", 1.0)
    config, params = load_pretrained(cfg.out_dir)
    assert config == cfg.model
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, state.params)
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md", "eval.json"):
        assert os.path.isfile(os.path.join(cfg.out_dir, name)), name

    # Stage 2 (configs/tiny_teacher_reuse.flags): init_from starts from the export's weights.
    stage2 = tiny_config(tmp_path, run_dir=str(tmp_path / "stage2"), out_dir=str(tmp_path / "out2"),
                         offset_heads=(), init_from=cfg.out_dir)
    optimizer = make_optimizer(stage2)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 init_state(stage2, optimizer).params, state.params)
    with pytest.raises(ValueError, match="different model"):
        init_state(dataclasses.replace(stage2, model=dataclasses.replace(cfg.model, hidden_size=48)), optimizer)
    with pytest.raises(ValueError, match="init_from"):
        tiny_config(tmp_path, init_from=cfg.out_dir)  # offset_heads only shape a fresh init
    card = model_card(stage2, [], "cmd2", 1.0)
    assert "### Before" in card and "sha256" in card and "Init: random" in card  # stage 1's own init, carried over


@pytest.mark.skipif(not os.path.isdir(TEACHER), reason="no shipped demo teacher")
def test_shipped_teacher_loads_and_answers():
    from transformers import AutoTokenizer

    from kvpop_jax.generate import generate
    from kvpop_jax.modeling import Qwen3ForCausalLM
    from kvpop_jax.sampling import SamplingConfig

    config, params = load_pretrained(TEACHER)
    tok = AutoTokenizer.from_pretrained(TEACHER)
    assert config.kvpop is None and config.num_key_value_heads < config.num_attention_heads
    assert config.vocab_size == len(tok) and tok.eos_token_id == config.eos_token_id == 2
    with open(os.path.join(TEACHER, "eval.json")) as f:
        prompt_len = json.load(f)["results"][-1]["prompt_len"]
    # Both tasks (stage 2 taught it reuse's recall lines): fresh problems, answered right.
    examples = [ex for task in ("read_once", "reuse")
                for ex in demo_task.generate_dataset(2, 7, "test", task=task, seq_len=prompt_len)]
    ids = np.asarray([tok(ex["prompt"])["input_ids"] for ex in examples])
    assert ids.shape == (4, prompt_len)
    tokens, lengths = generate(Qwen3ForCausalLM(config), params, jnp.asarray(ids), max_new_tokens=24,
                               sampling=SamplingConfig.greedy(), eos_ids=(tok.eos_token_id,), cache="dense")
    for ex, row, n in zip(examples, np.asarray(tokens), np.asarray(lengths)):
        text = tok.decode(row[:n].tolist(), skip_special_tokens=True)
        assert demo_task.score(text, ex["answer"]) == 1.0, (ex["meta"].get("task"), text, ex["answer"])


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_recall_head_reads_the_fact_on_recall_lines(seed):
    """The recall drills' `q=4` lines (the reuse task's recall lines until stop 33): the recall head
    predicts the digit bound to q before training, and the match head never takes such a line's digit
    for a binding; the reuse task's `>q4` recall lines are read like the question's lookups."""
    from kvpop_jax.modeling import Qwen3ForCausalLM, init_params

    config = Qwen3Config(vocab_size=len(VOCAB), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_bias=True,
                         rope_theta=1e8, tie_word_embeddings=True)
    base = init_offset_heads(init_params(config, jax.random.key(seed)), config, (1, 2))
    planted = plant_lookup_circuit(base, config, seed, recall_head=True)
    without = plant_lookup_circuit(base, config, seed)
    ids, weighted = recall_row(np.random.default_rng((seed, 7)), 200)
    row = np.asarray(ids)
    recall = (np.roll(row, 1) == VOCAB["="]) & np.isin(np.roll(row, 2), [VOCAB[n] for n in atoms.NAMES])
    recall = recall[1:] & weighted[1:]  # target j: the token at j + 1 is a recalled value
    model = Qwen3ForCausalLM(config)
    for params, expect in ((planted, True), (without, False)):
        pred = np.asarray(model.apply({"params": params}, jnp.asarray(row[None])).logits[0]).argmax(-1)
        right = pred[:-1][recall] == row[1:][recall]
        assert recall.sum() >= 8
        assert right.mean() >= 0.75 if expect else right.mean() < 0.5, (expect, right)  # training sharpens it
    task = demo_task.make_config("medium", "reuse", seq_len=1024)
    ex = demo_task.generate_example((seed, 99, 0), config=task)
    row = np.asarray(encode(ex["text"]))
    pred = np.asarray(model.apply({"params": planted}, jnp.asarray(row[None])).logits[0]).argmax(-1)
    recalled = [p for f in ex["meta"]["facts"] for p in f["reuse_pos"]]
    assert (pred[np.asarray(recalled) - 1] == row[recalled]).mean() >= 0.6  # hundreds of tokens back
    start = ex["meta"]["n_prompt_tokens"]  # the completion's lookups still find the binding itself
    lookups = [p for p in range(start + 1, len(row)) if row[p - 1] in [VOCAB[n] for n in atoms.NAMES]]
    assert (pred[np.asarray(lookups) - 1] == row[lookups]).all()


def test_recall_drills_and_reuse_rows(tmp_path):
    ids, weighted = recall_row(np.random.default_rng(3), 120)
    text = decode(ids)
    lines = text.split("\n")
    values = {ln[0]: ln[1] for ln in lines if len(ln) == 2}
    for ln in lines[len(values):-1]:
        if "=" in ln and not ln.startswith(">"):
            assert ln[2] == values[ln[0]]  # name=value recalls the bound value
    assert np.asarray(weighted).sum() > 10
    cfg = tiny_config(tmp_path, phases=parse_curriculum("1024:2:4:recall=0.25/reuse=0.5", 4))
    batch = make_batch(cfg, 0)
    assert decode(batch["input_ids"][0]).count("=") > 20  # the recall drill row
    reuse_rows = [decode(r) for r in batch["input_ids"][2:]]
    assert all("keep" in r for r in reuse_rows) and all(
        any(f"\n>{c}{d}\n" in r for c in atoms.NAMES for d in atoms.DIGITS) for r in reuse_rows)  # recall lines
    assert (batch["weights"][2:] == cfg.completion_weight).sum(-1).min() > 3 * 3  # recalls weigh like answers
    names = [VOCAB[n] for n in atoms.NAMES]
    for r in range(4):  # `recall` marks a reuse row's recall lines `>q4`: input the name after `>` on a line
        ids, targets, rec = batch["input_ids"][r], batch["targets"][r], batch["recall"][r]  # that ends after its digit
        want = (np.isin(ids, names) & (np.roll(ids, 1) == VOCAB[">"]) & (np.roll(ids, -2) == VOCAB["\n"])
                & (np.roll(ids, 2) == VOCAB["\n"]) & (np.arange(len(ids)) < cfg.phases[0].prompt_len))
        np.testing.assert_array_equal(rec, want if r >= 2 else np.zeros_like(rec))
        assert r < 2 or (rec.sum() == 9 and np.isin(targets[rec], [VOCAB[d] for d in atoms.DIGITS]).all())
    from train.demo_teacher.loop import _compiled  # the step's recall_acc: argmax hits at those targets, before the update
    model, optimizer, steps = _compiled(dataclasses.replace(cfg, run_dir="", out_dir=""))
    state = init_state(cfg, optimizer)
    pred = np.asarray(model.apply({"params": state.params}, jnp.asarray(batch["input_ids"])).logits).argmax(-1)
    want = np.mean(pred[batch["recall"]] == batch["targets"][batch["recall"]])
    _, metrics = steps[0.0](state, batch)
    assert float(metrics["recall_acc"]) == pytest.approx(want)


def test_park_mask_marks_the_binding_names(tmp_path):
    """`park_mask` against the diagnostic's reading of each name (eval.diagnose.name_kind, written
    from the token strings): parked are exactly the prompt's binding names ("names"), or every prompt
    query but the lookups after `>`, recall lines' included ("all")."""
    from eval.diagnose import name_kind
    from train.demo_teacher.data import park_mask

    cfg = tiny_config(tmp_path, phases=(Phase(1024, 2, 4, (("reuse", 0.5),)),))
    batch = make_batch(cfg, 0)
    for row in range(4):
        ids = np.concatenate([batch["input_ids"][row], batch["targets"][row, -1:]])
        tokens = [decode([i]) if i != BOS_ID else "<bos>" for i in ids]
        n_prompt = int(np.argmax(batch["completion"][row])) + 1  # target j is a completion token from j + 1 = n_prompt
        want = [name_kind(tokens, j, n_prompt) == "binding" for j in range(len(ids) - 1)]
        np.testing.assert_array_equal(batch["park"][row], want)
        np.testing.assert_array_equal(park_mask(ids, n_prompt), want)
        assert 20 < sum(want)  # bindings in every row
        reads = [j for j in range(1, n_prompt) if tokens[j - 1] == ">" and tokens[j].isalpha()]  # >g6: g's value
        assert row < 2 or sum(name_kind(tokens, j, n_prompt) == "recall" for j in reads) == 9  # reuse rows' recalls
        want_all = [1 <= j < n_prompt and j not in reads for j in range(len(ids) - 1)]
        np.testing.assert_array_equal(park_mask(ids, n_prompt, "all"), want_all)
        assert reads and sum(want_all) > 10 * len(reads)
    with pytest.raises(ValueError, match="park queries must be 'names' or 'all', got 'some'"):
        park_mask(ids, n_prompt, "some")


def test_state_saved_before_park_lookups_resumes_without_it(tmp_path):
    """A state whose settings predate `park_lookups` restores as a run without it, and is refused by a
    run with it."""
    import flax.serialization

    from train.demo_teacher.loop import restore_state, save_state

    cfg = tiny_config(tmp_path)
    state = init_state(cfg, make_optimizer(cfg))
    save_state(cfg, state, 3.0)
    path = os.path.join(cfg.run_dir, STATE_FILE)
    with open(path, "rb") as f:
        payload = flax.serialization.msgpack_restore(f.read())
    old = json.loads(payload["config"])
    del old["park_lookups"]
    payload["config"] = json.dumps(old)
    with open(path, "wb") as f:
        f.write(flax.serialization.msgpack_serialize(payload))
    restored, seconds = restore_state(cfg, state)
    assert seconds == 3.0 and int(restored.step) == 0
    with pytest.raises(ValueError, match=r"different settings: park_lookups false -> true\."):
        restore_state(dataclasses.replace(cfg, park_lookups=True), state)


@pytest.mark.parametrize("near,lookups", [*(pytest.param(n, False, marks=pytest.mark.long)  # ~20 s each
                                            for n in ("full", "band")), ("full", True), ("band", True)])
def test_park_loss_is_the_old_attention_of_the_parked_queries(tmp_path, rng, monkeypatch, near, lookups):
    """`park_loss` (from the forward's sown q, k and lse) against a loop over the parked queries, heads
    and layers of a random model's attention weights (with `lookups`, plus the lookups' old attention of
    every head but each layer's largest), its gradient against the same sum taken over the full
    weights; and a train step with `park_weight` logs it and lowers it."""
    from kvpop_jax.modeling import Qwen3ForCausalLM, dense_attention_probs, init_params
    from train.demo_teacher import loop
    from train.demo_teacher.loop import _compiled, forward_attention, park_loss

    monkeypatch.setattr(loop, "FULL_NEAR_MAX_LEN", 1024 if near == "full" else 0)  # both ways to the near mass

    cfg = tiny_config(tmp_path, model=dataclasses.replace(tiny_config(tmp_path).model, num_hidden_layers=2))
    params = init_params(cfg.model, jax.random.key(int(rng.integers(1 << 30))))
    params = jax.tree.map(lambda x: x * 3.0 if x.ndim >= 2 else x, params)  # sharper weights than at init
    model = Qwen3ForCausalLM(cfg.model)
    ids = jnp.asarray(rng.integers(3, len(VOCAB), size=(2, 48)))
    park = jnp.asarray(rng.random((2, 48)) < 0.3)
    look = jnp.asarray(rng.random((2, 48)) < 0.2) if lookups else None
    window = 5
    logits, attention = forward_attention(model, params, ids)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(model.apply({"params": params}, ids).logits))
    got = float(park_loss(attention, park, window, look))
    want, n, extra, n_look = 0.0, 0, 0.0, 0
    for layer in range(2):
        probs = np.asarray(dense_attention_probs(cfg.model, params, ids, layer))
        old = lambda b, h, d: sum(probs[b, h, d, t] for t in range(1, d - window + 1))  # noqa: E731
        for b, d in zip(*np.nonzero(np.asarray(park))):
            for h in range(cfg.model.num_attention_heads):
                want += old(b, h, d)
                n += 1
        for b, d in zip(*np.nonzero(np.asarray(look))) if lookups else ():
            per_head = [old(b, h, d) for h in range(cfg.model.num_attention_heads)]
            extra += sum(per_head) - max(per_head)
            n_look += len(per_head)
    want = want / n + (extra / n_look if lookups else 0.0)
    assert want > 0.1 and got == pytest.approx(want, rel=1e-4)
    assert not lookups or extra > 0.05

    s = ids.shape[1]
    old = (np.arange(s)[None] >= 1) & (np.arange(s)[None] <= np.arange(s)[:, None] - window)

    def full_weights(p):  # the same loss over the whole [B, H, S, S] weights
        per = [jnp.sum(jnp.where(old, dense_attention_probs(cfg.model, p, ids, i), 0.0), -1) for i in range(2)]
        loss = sum(jnp.sum(m * park[:, None]) for m in per) / (2 * cfg.model.num_attention_heads * jnp.sum(park))
        if lookups:
            loss += sum(jnp.sum((m.sum(1) - m.max(1)) * look) for m in per) / (
                2 * cfg.model.num_attention_heads * jnp.sum(look))
        return loss

    want_grad = jax.grad(full_weights)(params)
    got_grad = jax.grad(lambda p: park_loss(forward_attention(model, p, ids)[1], park, window, look))(params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-3, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want_grad)) > 1e-3

    cfg = dataclasses.replace(cfg, park_weight=5.0, park_window=8, park_lookups=lookups, phases=(Phase(128, 8, 4),))
    _, optimizer, steps = _compiled(dataclasses.replace(cfg, run_dir="", out_dir=""))
    step = steps[5.0]
    state = init_state(cfg, optimizer)
    logged = []
    for i in range(8):
        state, metrics = step(state, make_batch(cfg, i))
        logged.append(float(metrics["park"]))
    assert logged[-1] < 0.7 * logged[0], logged


def test_phase_park_weight_runs_the_parking_step_only_in_its_phase(tmp_path):
    """`park=W` in a curriculum phase overrides --park_weight there: the run logs the parking loss in
    that phase only (a phase without it runs the step that does not compute it), the model card says
    so, and a negative or non-numeric weight is refused before step 0."""
    phases = parse_curriculum("128:4:2, 128:4:2:park=2", 4)
    assert [p.task for p in phases] == [(), (("park", 2),)]
    cfg = tiny_config(tmp_path, phases=phases, park_queries="all", log_every=1, checkpoint_every=8)
    assert [cfg.park_weight_of(p) for p in cfg.phases] == [0.0, 2.0]
    assert cfg.task(cfg.phases[1]) == cfg.task(cfg.phases[0])  # park is not a demo-task field
    _, records = train(cfg, progress=False)
    logged = {r["step"]: r for r in records if "loss" in r}
    assert sorted(logged) == list(range(1, 9))
    assert all("park" not in logged[s] for s in range(1, 5)) and all(logged[s]["park"] > 0 for s in range(5, 9))
    assert not any("recall_acc" in r for r in logged.values())  # no reuse rows at 128 tokens: not logged
    assert "(per phase: 0, 2) x the parking loss" in model_card(cfg, [], "", 0.0)
    for bad in ("park=-1", "park=x"):
        with pytest.raises(ValueError, match="park="):
            tiny_config(tmp_path, phases=parse_curriculum(f"128:4:2:{bad}", 4))


def _main(argv, capsys):
    """train.pretrain's main on fresh flag values: (exit code or None, stderr)."""
    from train.demo_teacher import main as pretrain_main

    fv = flags.FlagValues()
    define_flags(fv)
    fv(["pretrain", *argv])
    code = None
    with mock.patch.object(pretrain_main, "FLAGS", fv), mock.patch.object(pretrain_main, "run") as run:
        try:
            pretrain_main.main(["pretrain"])
        except SystemExit as e:
            code = e.code
    return code, capsys.readouterr().err, run


def test_cli_refuses_before_any_work(tmp_path, capsys):
    """What the probe found train.pretrain doing: overwriting the shipped teacher by default, ignoring shape
    flags under --init_from, crashing after training on counts of 0, skipping lengths silently."""
    tiny = ["--hidden_size=32", "--intermediate_size=64", "--num_layers=1", "--num_heads=2", "--num_kv_heads=1",
            "--head_dim=16", "--curriculum=128:2:2", f"--run_dir={tmp_path / 'run'}"]
    held = tmp_path / "held"
    held.mkdir()
    (held / "config.json").write_text("{}")
    bad = [
        ([f"--out_dir={held}"], f"--out_dir={held} already holds a model (config.json): pass --overwrite_out_dir"),
        (["--final_eval_examples=0"], "final_eval_examples must be an int >= 1, got 0"),
        (["--log_every=0"], "log_every must be an int >= 1, got 0"),
        (["--eval_every=2", "--eval_examples=0"], "eval_examples >= 1 when it evaluates"),
        (["--seed=-1"], "seed must be in [0, 2**32), got -1"),
        (["--curriculum="], "--curriculum='' needs at least one phase"),
        (["--offset_heads=a"], "--offset_heads='a' must be comma-separated integers"),
        (["--final_eval_lens=100,-5"], "final_eval_lens holds 100: seq_len=100 is too short"),
        (["--curriculum=128:1:4:drill=abc"], "drill='abc' must be a share of the batch in [0, 1]"),
        (["--curriculum=128:1:4:reuse=2"], "reuse=2 must be a share of the batch in [0, 1]"),
        (["--curriculum=128:1:4:drill=0.8/lookup=0.8"], "drill, lookup and recall rows take all 4 rows"),
        (["--curriculum=128:1:4:seq_len=200"], "seq_len is the phase's LEN, not an override"),
        (["--curriculum=128:1:4:lookp=0.5"], "unknown override 'lookp'; known: drill, lookup"),  # was a traceback
        ([f"--out_dir={tmp_path / 'f' / 'x'}"], "--out_dir"),
        ([f"--init_from={tmp_path / 'stage1'}"], "does not exist (a stage's --init_from is the --out_dir of the stage "
                                                 "before it: train that one first)"),
        ([f"--init_from={os.path.join(TEACHER, 'config.json')}"], "is a file; pass the folder that holds it"),
    ]
    (tmp_path / "f").write_text("a file")
    for argv, message in bad:
        code, err, run = _main([*tiny, *argv], capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)
        run.assert_not_called()
    config = Qwen3Config.from_hf(TEACHER)
    code, err, run = _main(["--init_from=" + TEACHER, "--hidden_size=64", "--curriculum=1024:2:2",
                            f"--run_dir={tmp_path / 'run'}", f"--out_dir={tmp_path / 'out'}"], capsys)
    assert code == 2 and f"fixes the model's shape; drop --hidden_size=64 (the checkpoint's {config.hidden_size})" \
        in err, err
    code, err, run = _main([*tiny, f"--out_dir={held}", "--overwrite_out_dir"], capsys)
    assert code is None and run.called  # replacing it is a choice
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["pretrain", "--curriculum=128:1:4:cot=False"])
    assert dict(config_from_flags(fv).phases[0].task)["cot"] is False  # the string "False" was truthy
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["pretrain", "--curriculum=1024:1:4:task=reuse/difficulty=easy"])  # make_config's presets are overrides too
    cfg = config_from_flags(fv)
    assert cfg.task(cfg.phases[0]).n_reuse > 0
    # --eval_only does not need --init_from to exist (the shipped flagfiles' eval command crashed on it)
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["pretrain", f"--flagfile={os.path.join(REPO, 'configs', 'tiny_teacher_park_all.flags')}", "--eval_only",
        "--init_from=/nonexistent"])
    assert config_from_flags(fv).init_from == "/nonexistent"


def test_a_resume_logs_each_step_once(tmp_path):
    """Killed after logging steps it had not saved, a resumed run logged them again (6-8 twice)."""
    cfg = tiny_config(tmp_path, checkpoint_every=4, log_every=1)
    train(cfg, progress=False, stop_at=10)  # saves at 4, 8 and 10 (the stop)
    path = os.path.join(cfg.run_dir, "metrics.jsonl")
    with open(path, "a") as f:  # as if killed at 11 after logging it, with the last save at 10
        f.write(json.dumps(dict(step=11, loss=1.0)) + "\n")
    train(cfg, progress=False)
    steps = [json.loads(line)["step"] for line in open(path) if "loss" in line]
    assert steps == list(range(1, cfg.total_steps + 1)), steps


def test_an_export_that_dies_leaves_no_weights_without_their_card(tmp_path, monkeypatch):
    """The weights, the tokenizer, eval.json and the model card land together. Before, a failure (or a kill)
    between the weights and the card left a model in --out_dir that the rerun was refused to replace."""
    from train.demo_teacher import evaluate as evaluate_module

    cfg = tiny_config(tmp_path)
    params = init_state(cfg, make_optimizer(cfg)).params

    def broken_card(*args, **kwargs):
        raise RuntimeError("killed while writing the model card")

    monkeypatch.setattr(evaluate_module, "model_card", broken_card)
    with pytest.raises(RuntimeError, match="killed while writing"):
        export(cfg, params, [], "cmd", 1.0)
    assert not os.path.exists(cfg.out_dir)
    monkeypatch.undo()
    export(cfg, params, [], "cmd", 1.0)
    assert {"config.json", "model.safetensors", "tokenizer.json", "eval.json", "README.md"} <= set(
        os.listdir(cfg.out_dir))
    assert load_pretrained(cfg.out_dir)[0] == cfg.model
