"""The demo teacher's held-out accuracy and its export (HF checkpoint, tokenizer, model card).

Accuracy is exact match of the boxed answer in completions generated from demo-task prompts
(greedy unless a SamplingConfig is given) with the dense cache, as `eval.accuracy` scores them.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from demo import task as demo_task
from demo.atoms import VOCAB
from demo.tokenizer import save_tokenizer
from kvpop_jax import save_pretrained
from kvpop_jax.generate import generate
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params
from kvpop_jax.sampling import SamplingConfig
from train.demo_teacher.config import PretrainConfig
from train.demo_teacher.data import EOS_ID, decode, encode


def evaluate(model: Qwen3ForCausalLM, params, cfg: PretrainConfig, task: demo_task.DemoTaskConfig | int, n: int,
             *, split: str = "validation", batch: int = 16, sampling: SamplingConfig | None = None) -> dict:
    """Exact-match accuracy of generated completions on n `split` prompts of `task` (or of the
    plain task at that prompt length).

    Greedy by default; returns dict(accuracy, n, prompt_len, samples=[(id, answer, completion)]).
    """
    task = cfg.task(task) if isinstance(task, int) else task
    prompt_len = task.seq_len
    examples = demo_task.generate_dataset(n, cfg.seed, split, config=task)
    ids = np.asarray([encode(ex["prompt"]) for ex in examples], np.int32)
    batch = min(batch, n)
    sampling = sampling or SamplingConfig.greedy()
    texts = []
    for start in range(0, n, batch):
        chunk = ids[start : start + batch]
        rows = len(chunk)
        if rows < batch:  # keep one compiled shape
            chunk = np.concatenate([chunk, np.repeat(chunk[:1], batch - rows, 0)])
        tokens, lengths = generate(model, params, chunk, max_new_tokens=task.completion_tokens + 2,
                                   sampling=sampling, eos_ids=(EOS_ID,), cache="dense",
                                   rng=jax.random.key(start))
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        texts += [decode(tokens[r, : lengths[r]]) for r in range(rows)]
    correct = [demo_task.score(t, ex["answer"]) for t, ex in zip(texts, examples)]
    out = dict(accuracy=float(np.mean(correct)), n=n, prompt_len=prompt_len, split=split,
               samples=[(ex["id"], ex["answer"], t) for ex, t in zip(examples, texts)])
    if task.n_reuse:
        out["recall_accuracy"] = recall_accuracy(model, params, examples, batch)
    return out


def recall_accuracy(model: Qwen3ForCausalLM, params, examples: list[dict], batch: int = 16) -> float:
    """Share of the reuse task's recalled values (`>q4`: the digit after the name) that the model predicts
    (argmax, teacher forced on the whole text). The demo's future-attention target sees a fact's reuse
    only if the teacher reads the fact at its recalls: a teacher that answers the final question but
    guesses the recalls (0.1) leaves the fact one read, as in read_once (BENCHMARKS.md, stop 33)."""
    rows = [encode(ex["text"]) for ex in examples]
    width = max(map(len, rows))
    ids = np.asarray([r + [EOS_ID] * (width - len(r)) for r in rows], np.int32)  # causal: the tail pads nothing
    hits = []
    for start in range(0, len(rows), batch):
        pred = np.asarray(jnp.argmax(model.apply({"params": params}, jnp.asarray(ids[start:start + batch])).logits, -1))
        for r, ex in enumerate(examples[start:start + batch]):
            reads = np.asarray([p for f in ex["meta"]["facts"] for p in f["reuse_pos"]], int)
            hits += list(pred[r, reads - 1] == ids[start + r, reads])
    return float(np.mean(hits))


def final_eval(cfg: PretrainConfig, params, sampling: SamplingConfig | None = None) -> list[dict]:
    """Test-split accuracy of both demo tasks at each of cfg.final_eval_lens (greedy unless
    `sampling`; the reuse task only at lengths it fits)."""
    model = Qwen3ForCausalLM(cfg.model)
    results = []
    for task_name in demo_task.TASKS:
        for length in cfg.final_eval_lens:
            try:
                task = demo_task.make_config(cfg.difficulty, task_name, seq_len=length)
            except ValueError as e:  # reuse at a length too short for it (read_once is checked up front)
                print(f"test accuracy on {task_name} at prompt length {length}: not measured ({e})")
                continue
            r = evaluate(model, params, cfg, task, cfg.final_eval_examples, split="test", batch=cfg.eval_batch,
                         sampling=sampling)
            r["task"] = task_name
            recalls = (f"; recalled values read (teacher forced) {r['recall_accuracy']:.3f}"
                       if "recall_accuracy" in r else "")
            print(f"test accuracy on {task_name} at prompt length {length}: {r['accuracy']:.3f} ({r['n']} problems, "
                  f"{'greedy' if sampling is None else sampling}){recalls}")
            results.append(r)
    return results


def export(cfg: PretrainConfig, params, results: list[dict], command: str, train_seconds: float | None) -> None:
    """OUT_DIR: save_pretrained + demo tokenizer + eval.json + README.md (model card), swapped in together
    (`save_pretrained`'s staged directory): a killed export leaves OUT_DIR as it was, not weights without
    their card, which the rerun would then have to overwrite."""
    dtype = jnp.bfloat16 if cfg.export_dtype == "bfloat16" else jnp.float32
    params = jax.tree.map(lambda x: np.asarray(x).astype(dtype), jax.device_get(params))
    keys = ("task", "prompt_len", "split", "n", "accuracy", "recall_accuracy")
    summary = [{k: r.get(k, "read_once") for k in keys if k in r or k == "task"} for r in results]
    with tempfile.TemporaryDirectory() as extra:
        save_tokenizer(extra)
        with open(os.path.join(extra, "eval.json"), "w") as f:
            json.dump(dict(results=summary, samples={f"{r.get('task', 'read_once')}@{r['prompt_len']}":
                                                     r["samples"][:3] for r in results}), f, indent=1)
        with open(os.path.join(extra, "README.md"), "w") as f:
            f.write(model_card(cfg, summary, command, train_seconds))
        save_pretrained(cfg.model, params, cfg.out_dir,
                        extra_files={name: os.path.join(extra, name) for name in sorted(os.listdir(extra))})


def model_card(cfg: PretrainConfig, results: list[dict], command: str, train_seconds: float | None) -> str:
    m = cfg.model
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(m, jax.random.key(0)))))
    phases = "\n".join(f"| {i + 1} | {p.prompt_len} | {p.prompt_len + cfg.task(p).completion_tokens + 1} "
                       f"| {p.batch} | {p.steps} | {' '.join(f'{k}={v}' for k, v in p.task) or '-'} |"
                       for i, p in enumerate(cfg.phases))
    accuracy = "\n".join(f"| {r.get('task', 'read_once')} | {r['prompt_len']} | {r['split']} | {r['n']} | "
                         f"{r['accuracy']:.1%} | "
                         + (f"{r['recall_accuracy']:.1%} |" if "recall_accuracy" in r else "- |") for r in results)
    minutes = f"{train_seconds / 60:.0f} min" if train_seconds else "n/a"
    park = ""
    weights = [cfg.park_weight_of(p) for p in cfg.phases]
    if any(weights):
        who = ("every prompt query but a lookup (a name after `>`)"
               if cfg.park_queries == "all" else "the name of a binding")
        how = (f"{weights[0]:g} x" if len(set(weights)) == 1 else
               "(per phase: " + ", ".join(f"{w:g}" for w in weights) + ") x")
        also = (", and at each lookup (a name after `>`) the old attention of every head but the layer's largest "
                "(one head reads the fact)" if cfg.park_lookups else "")
        park = (f" Plus {how} the parking loss (`train/demo_teacher/loop.py`, `park_loss`): the mean "
                f"attention that {who} pays to keys {cfg.park_window} or more "
                f"tokens back, over every head{also}, so that the teacher does not look up a value its next token "
                "cannot use.")
    init = "random (Flax defaults)"
    if cfg.offset_heads:
        init += (f", with layer 0's KV heads starting as fixed-offset heads {cfg.offset_heads} (q/k biases; "
                 "`init_offset_heads`)")
    if cfg.lookup_circuit:
        init = ("mechanistic; the lookup circuit is planted, not learned (`train/demo_teacher/init.py`, "
                "`plant_lookup_circuit`). Embeddings give each name a low-coherence code and each other token "
                "a random identity vector; layer 0 starts with a previous-token head that copies the previous "
                "name's code, layer 1 with a head that matches the current name against it on the slowest "
                "rotary pairs and copies the digit bound to it"
                + (", and a recall head that does the same match from the previous token's code (`q=4` lines, "
                   "the reuse task's recall lines until stop 33 and the recall drills)" if cfg.recall_head else "")
                + ". Training from a random init never left chance on this associative recall within a CPU "
                "budget; here all weights, the planted ones included, are then trained by the curriculum below")
    stage1 = ""
    if cfg.init_from:
        init = f"the trained weights of `{cfg.init_from}` ({_init_digest(cfg.init_from)}), trained as in *Before* below"
        stage1 = _init_training_section(cfg.init_from)
    return f"""# demo-teacher: a tiny dense Qwen3 for the KVpop CPU demo

A {n_params / 1e6:.2f}M-parameter Qwen3 trained from scratch on the bundled demo tasks
(`demo/task.py`, difficulty `{cfg.difficulty}`) by `python -m train.pretrain`. It is the dense
teacher that `train.main` retrofits with KVpop. Tokenizer: `demo/tokenizer.py` (one token
per atom, vocab {len(VOCAB)}).

## Architecture

{m.num_hidden_layers} layers, hidden {m.hidden_size}, SwiGLU {m.intermediate_size}, {m.num_attention_heads} query
heads / {m.num_key_value_heads} KV heads (GQA), head_dim {m.head_dim}, RoPE theta {m.rope_theta:g}, tied
embeddings, weights {cfg.export_dtype}.

## Training

Init: {init}.

Generated train-split traces `<bos> prompt completion <eos>` (seed {cfg.seed}); loss weight
{cfg.prompt_weight:g} on prompt tokens, {cfg.completion_weight:g} on completion tokens. AdamW
(b1 {cfg.b1}, b2 {cfg.b2}, weight decay {cfg.weight_decay}), peak LR {cfg.lr:g}, {cfg.warmup_steps} warmup
steps, cosine to {cfg.final_lr:g}, clip {cfg.clip_norm}.{park} Training time: {minutes} on CPU.

| phase | prompt tokens | row tokens | batch | steps | task overrides |
|---|---|---|---|---|---|
{phases}

Reproduce: `{command}`
{stage1}
## Held-out accuracy

Greedy exact match of the boxed answer on held-out test-split problems (`train.pretrain`'s
final eval; rerun with `{command} --eval_only`), and for the reuse task the share of its recalled
values (`>q4`) the teacher predicts, teacher forced: the future-attention target sees a fact's reuse
only if the teacher reads the fact there (a teacher that guesses them, ~10%, leaves the demo's KVpop
nothing to learn from the mean target; BENCHMARKS.md, stop 33):

| task | prompt tokens | split | problems | pass@1 (greedy) | recalls read |
|---|---|---|---|---|---|
{accuracy}
"""


def _init_digest(init_dir: str) -> str:
    """`model.safetensors sha256 <first 16 hex>` of an init checkpoint (which stage-1 export this was)."""
    path = os.path.join(init_dir, "model.safetensors")
    with open(path, "rb") as f:
        return f"model.safetensors sha256 {hashlib.sha256(f.read()).hexdigest()[:16]}"


def _init_training_section(init_dir: str) -> str:
    """The init checkpoint's own `## Training` section (its card, with its own earlier stages), as this
    card's *Before*."""
    card = os.path.join(init_dir, "README.md")
    if not os.path.isfile(card):
        return f"\n### Before (`{init_dir}`)\n\n`{init_dir}` has no model card.\n"
    text = open(card).read()
    start, end = text.find("## Training"), text.find("## Held-out")
    body = text[start + len("## Training"): end if end > start else None].strip() if start >= 0 else "(no training section)"
    body = body.replace("\n### ", "\n#### ")  # its own earlier stages, one level deeper
    return f"\n### Before (`{init_dir}`)\n\n{body}\n"
