"""Pretrains the demo teacher: a tiny dense Qwen3 trained from scratch on the demo task.

    python -m train.pretrain --flagfile=configs/tiny_teacher.flags            # train + export
    python -m train.pretrain --flagfile=configs/tiny_teacher.flags --eval_only  # re-measure

Data (`train/pretrain_data.py`): demo-task traces (`eval/demo_task.py`) generated on the fly,
deterministic by (seed, step), one whole `<bos> prompt completion <eos>` trace per row.

Init (`--offset_heads`, `--lookup_circuit`, `train/pretrain_init.py`): a plain model sits on
long plateaus here. A looked-up value and a mod-10 result are each independent of any single
token it can already attend to, so there is no first-order gradient towards those circuits; the
long-range lookup (an associative recall among ~300 bindings) stays at chance for as many steps
as a CPU run has. So the lookup circuit is not learned but planted: `--lookup_circuit` writes a
previous-token head (layer 0) and a name-matching copy head (layer 1) into the initial weights,
a mechanistic init that training then adapts along with everything else.

Curriculum (`--curriculum=LEN:STEPS[:BATCH][:OVERRIDES],...`): phases of prompt length LEN, each
optionally with demo-task overrides and shares of arithmetic and lookup drill rows (`drill=F`,
`lookup=F`). Short traces with extra scratch lines and drills whose answers depend on each
operand teach the format and the mod-10 tables in a few hundred steps; longer phases then
stretch the lookups to the demo length.

Loss: next-token cross-entropy over the whole trace; completion tokens (and <eos>) and drill
results weigh `completion_weight`, other tokens `prompt_weight`; the mean is over the weights.
Optimizer: AdamW (no decay on norms), linear warmup then cosine to `final_lr` over all phases,
global-norm clipping.

Outputs: RUN_DIR/state.msgpack (params, optimizer state, step, one file replaced atomically;
rerunning the command resumes from it), RUN_DIR/metrics.jsonl (train metrics, and greedy
validation accuracy every `eval_every` steps), and OUT_DIR (`train/pretrain_eval.py`:
save_pretrained + the demo tokenizer + eval.json + README.md model card) with test-split
accuracy at each of `final_eval_lens`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import sys
import time

import flax.serialization
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from eval import demo_task
from eval.demo_tokenizer import VOCAB
from kvpop_jax.checkpoint import atomic_write_bytes
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params
from kvpop_jax.sampling import SamplingConfig
from train.pretrain_data import BOS_ID, EOS_ID, MAX_BATCH, Phase, make_batch, parse_curriculum
from train.pretrain_eval import evaluate, export, final_eval
from train.pretrain_init import init_offset_heads, plant_lookup_circuit

STATE_FILE = "state.msgpack"
METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Everything a run needs; `resume_key` names the settings a resumed run may not change."""

    model: Qwen3Config
    phases: tuple[Phase, ...]
    run_dir: str
    out_dir: str
    difficulty: str = "medium"
    seed: int = 0
    lr: float = 3e-3
    final_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.05
    b1: float = 0.9
    b2: float = 0.98
    clip_norm: float = 1.0
    prompt_weight: float = 1.0
    completion_weight: float = 5.0
    eval_every: int = 250
    eval_examples: int = 32
    eval_batch: int = 16
    final_eval_examples: int = 200
    final_eval_lens: tuple[int, ...] = ()
    checkpoint_every: int = 100
    log_every: int = 20
    export_dtype: str = "float32"
    offset_heads: tuple[int, ...] = ()  # KV head i of layer 0 starts attending offset_heads[i] back
    lookup_circuit: bool = False  # plant the name -> digit lookup circuit (train/pretrain_init.py)

    def __post_init__(self):
        if not self.phases:
            raise ValueError("the curriculum needs at least one phase")
        for p in self.phases:
            if p.steps < 1 or not 1 <= p.batch <= MAX_BATCH:
                raise ValueError(f"phase {p}: need steps >= 1 and 1 <= batch <= {MAX_BATCH}")
            self.task(p)  # validates the length and the overrides
        if self.difficulty not in demo_task.DIFFICULTY:
            raise ValueError(f"difficulty must be one of {sorted(demo_task.DIFFICULTY)}, got {self.difficulty!r}")
        if self.model.vocab_size < len(VOCAB):
            raise ValueError(f"vocab_size={self.model.vocab_size} < the demo tokenizer's {len(VOCAB)}")
        if self.export_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"export_dtype must be float32 or bfloat16, got {self.export_dtype!r}")
        if self.offset_heads and not self.model.attention_bias:
            raise ValueError("offset_heads needs a model with attention_bias=True (the heads are q/k biases)")
        if self.lookup_circuit and self.offset_heads[:1] != (1,):
            raise ValueError("lookup_circuit needs offset_heads to start with 1 (its previous-token head)")
        if len(self.offset_heads) > self.model.num_key_value_heads or any(o < 1 for o in self.offset_heads):
            raise ValueError(f"offset_heads={self.offset_heads}: at most one offset >= 1 per KV head "
                             f"({self.model.num_key_value_heads})")

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def phase_at(self, step: int) -> Phase:
        """The phase that global step `step` (0-based) belongs to."""
        for p in self.phases:
            if step < p.steps:
                return p
            step -= p.steps
        return self.phases[-1]

    def task(self, phase: Phase | int) -> demo_task.DemoTaskConfig:
        """The demo task of a phase (or the plain task at a prompt length)."""
        if isinstance(phase, int):
            return demo_task.make_config(self.difficulty, seq_len=phase)
        overrides = dict(phase.task)
        for drill in ("drill", "lookup"):  # not task fields: the shares of drill rows
            overrides.pop(drill, None)
        difficulty = overrides.pop("difficulty", self.difficulty)
        return demo_task.make_config(difficulty, seq_len=phase.prompt_len, **overrides)

    def resume_key(self) -> dict:
        """The settings a resumed run must share with the saved one."""
        keys = ("phases", "difficulty", "seed", "lr", "final_lr", "warmup_steps", "weight_decay", "b1", "b2",
                "clip_norm", "prompt_weight", "completion_weight", "offset_heads", "lookup_circuit")
        return json.loads(json.dumps(dict(model=self.model.to_hf(),  # phases' tuples become lists
                                          **{k: dataclasses.asdict(self)[k] for k in keys})))


# ------------------------------------------------------------------------------------ train


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: optax.OptState


def make_optimizer(cfg: PretrainConfig) -> optax.GradientTransformation:
    total = cfg.total_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, min(cfg.warmup_steps, total - 1), max(total, 2),
                                                  end_value=cfg.final_lr)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731  no decay on norms
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask))


def init_state(cfg: PretrainConfig, optimizer) -> TrainState:
    params = init_params(cfg.model, jax.random.key(cfg.seed))
    params = init_offset_heads(params, cfg.model, cfg.offset_heads)
    if cfg.lookup_circuit:
        params = plant_lookup_circuit(params, cfg.model, cfg.seed)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def make_train_step(model: Qwen3ForCausalLM, optimizer):
    """jitted (state, batch) -> (state, metrics); batch as `pretrain_data.make_batch` ([B, S] arrays).

    Metrics: the weighted loss, the plain mean CE, and over completion tokens their CE, token
    accuracy and the share of rows whose whole completion is argmax-right (teacher forced).
    """

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["input_ids"]).logits  # [B, S, V]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])  # [B, S]
        w = batch["weights"]
        loss = jnp.sum(ce * w) / jnp.sum(w)
        comp = batch["completion"].astype(jnp.float32)
        correct = (jnp.argmax(logits, -1) == batch["targets"]).astype(jnp.float32)
        has_completion = jnp.any(batch["completion"], axis=-1).astype(jnp.float32)  # drill rows have none
        metrics = dict(loss=loss, ce=jnp.mean(ce),
                       completion_ce=jnp.sum(ce * comp) / jnp.sum(comp),
                       completion_token_acc=jnp.sum(correct * comp) / jnp.sum(comp),
                       # a completion is right iff all its tokens are (teacher-forced exact match)
                       completion_exact=jnp.sum(jnp.all((correct > 0) | ~batch["completion"], axis=-1) * has_completion)
                       / jnp.maximum(jnp.sum(has_completion), 1.0))
        return loss, metrics

    @functools.partial(jax.jit, donate_argnums=(0,))
    def train_step(state: TrainState, batch):
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics["grad_norm"] = optax.global_norm(grads)
        params = optax.apply_updates(state.params, updates)
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


# ------------------------------------------------------------------------------- checkpoint


def save_state(cfg: PretrainConfig, state: TrainState, elapsed_s: float = 0.0) -> None:
    """params + optimizer state + step + the settings + training seconds so far, as one
    atomically replaced file."""
    payload = dict(state=flax.serialization.to_state_dict(jax.device_get(state)),
                   config=json.dumps(cfg.resume_key()), elapsed_s=float(elapsed_s))
    os.makedirs(cfg.run_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(cfg.run_dir, STATE_FILE), flax.serialization.msgpack_serialize(payload))


def restore_state(cfg: PretrainConfig, target: TrainState) -> tuple[TrainState, float] | None:
    """(state, training seconds so far) of this run, or None if nothing is saved; refuses a state
    saved with other settings."""
    path = os.path.join(cfg.run_dir, STATE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        payload = flax.serialization.msgpack_restore(f.read())
    saved = json.loads(payload["config"])
    if saved != cfg.resume_key():
        diff = sorted(k for k in saved.keys() | cfg.resume_key().keys() if saved.get(k) != cfg.resume_key().get(k))
        raise ValueError(f"{path} was saved with different settings ({', '.join(diff)}); "
                         "use another --run_dir or delete it")
    return flax.serialization.from_state_dict(target, payload["state"]), float(payload.get("elapsed_s", 0.0))


# ------------------------------------------------------------------------------------- main


def _log(cfg: PretrainConfig, record: dict) -> None:
    with open(os.path.join(cfg.run_dir, METRICS_FILE), "a") as f:
        f.write(json.dumps(record) + "\n")


@functools.lru_cache(maxsize=4)
def _compiled(cfg: PretrainConfig):
    """Model, optimizer and jitted step of a config (cached: a resumed run in the same process
    reuses the compiled step)."""
    model, optimizer = Qwen3ForCausalLM(cfg.model), make_optimizer(cfg)
    return model, optimizer, make_train_step(model, optimizer)


def train(cfg: PretrainConfig, *, progress: bool = True, stop_at: int | None = None) -> tuple[TrainState, list[dict]]:
    """Runs (or resumes) the curriculum to cfg.total_steps (or only to `stop_at`, as if interrupted
    there); returns the state and the log records of this call (train records carry `elapsed_s`,
    training seconds since step 0 across resumes). Saves RUN_DIR/state.msgpack every
    `checkpoint_every` steps and at the end."""
    from tqdm.auto import tqdm

    os.makedirs(cfg.run_dir, exist_ok=True)
    model, optimizer, train_step = _compiled(dataclasses.replace(cfg, run_dir="", out_dir=""))
    state, elapsed = init_state(cfg, optimizer), 0.0
    restored = restore_state(cfg, state)
    if restored is not None:
        state, elapsed = restored
    start = int(state.step)
    clock = time.perf_counter() - elapsed  # elapsed = time.perf_counter() - clock, across resumes
    records: list[dict] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(make_batch, cfg, start) if start < cfg.total_steps else None
    bar = tqdm(total=cfg.total_steps, initial=start, desc="pretrain", disable=not progress, mininterval=5,
               dynamic_ncols=True, file=sys.stderr)
    window = dict(tokens=0, time=time.perf_counter())
    end = cfg.total_steps if stop_at is None else min(stop_at, cfg.total_steps)
    for step in range(start, end):
        batch = future.result()
        future = pool.submit(make_batch, cfg, step + 1) if step + 1 < end else None
        state, metrics = train_step(state, batch)
        window["tokens"] += batch["input_ids"].size
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.total_steps:
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            tok_s = window["tokens"] / max(now - window["time"], 1e-9)
            window.update(tokens=0, time=now)
            record = dict(step=done, prompt_len=cfg.phase_at(step).prompt_len, tokens_per_s=round(tok_s),
                          elapsed_s=round(now - clock),
                          **{k: round(v, 5) for k, v in metrics.items()})
            records.append(record)
            _log(cfg, record)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", comp=f"{metrics['completion_ce']:.3f}",
                            exact=f"{metrics['completion_exact']:.2f}", tok_s=f"{tok_s:.0f}")
            bar.write(json.dumps(record))
        if done % cfg.checkpoint_every == 0 or done == end:
            save_state(cfg, state, time.perf_counter() - clock)
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.total_steps):
            tasks = dict.fromkeys([cfg.task(cfg.phase_at(step)), cfg.task(cfg.phases[-1])])
            for task in tasks:  # the task of this phase and of the last one
                result = evaluate(model, state.params, cfg, task, cfg.eval_examples, batch=cfg.eval_batch)
                record = dict(step=done, eval_prompt_len=task.seq_len, eval_accuracy=result["accuracy"],
                              eval_n=result["n"], sample=result["samples"][0][2])
                records.append(record)
                _log(cfg, record)
                bar.write(json.dumps(record))
        bar.update(1)
    bar.close()
    pool.shutdown()
    return state, records


FLAGS = flags.FLAGS


def define_flags(fv: flags.FlagValues = FLAGS) -> None:
    d = dict(flag_values=fv)
    flags.DEFINE_string("run_dir", "runs/demo_teacher", "Training state, metrics log (resumes from here).", **d)
    flags.DEFINE_string("out_dir", "checkpoints/demo-teacher", "Exported HF-format teacher + tokenizer.", **d)
    flags.DEFINE_integer("hidden_size", 192, "Model width.", **d)
    flags.DEFINE_integer("intermediate_size", 512, "SwiGLU width.", **d)
    flags.DEFINE_integer("num_layers", 3, "Decoder layers.", **d)
    flags.DEFINE_integer("num_heads", 4, "Query heads.", **d)
    flags.DEFINE_integer("num_kv_heads", 2, "KV heads (GQA).", **d)
    flags.DEFINE_integer("head_dim", 48, "Head dimension.", **d)
    flags.DEFINE_float("rope_theta", 10_000.0, "RoPE base.", **d)
    flags.DEFINE_integer("max_position_embeddings", 4096, "Recorded in config.json.", **d)
    flags.DEFINE_string("offset_heads", "", "Comma-separated offsets: KV head i of layer 0 starts as an "
                        "offset-i-back head (sets attention_bias); e.g. 1,2. Empty: plain random init.", **d)
    flags.DEFINE_bool("lookup_circuit", False, "Plant the lookup circuit at init (train/pretrain_init.py); "
                      "needs offset_heads=1,...", **d)
    flags.DEFINE_string("difficulty", "medium", "Demo task difficulty (easy|medium|hard).", **d)
    flags.DEFINE_integer("seed", 0, "Data and init seed.", **d)
    flags.DEFINE_string("curriculum", "256:1000,1024:500", "Phases LEN:STEPS[:BATCH] (prompt length, steps, rows).", **d)
    flags.DEFINE_integer("batch", 16, "Rows per step where a phase does not say.", **d)
    flags.DEFINE_float("lr", 3e-3, "Peak learning rate.", **d)
    flags.DEFINE_float("final_lr", 1e-4, "Learning rate at the last step (cosine).", **d)
    flags.DEFINE_integer("warmup_steps", 100, "Linear warmup steps.", **d)
    flags.DEFINE_float("weight_decay", 0.05, "AdamW decoupled weight decay (matrices only).", **d)
    flags.DEFINE_float("b1", 0.9, "Adam beta1.", **d)
    flags.DEFINE_float("b2", 0.98, "Adam beta2.", **d)
    flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clip.", **d)
    flags.DEFINE_float("prompt_weight", 1.0, "Loss weight of prompt tokens.", **d)
    flags.DEFINE_float("completion_weight", 5.0, "Loss weight of completion tokens (and <eos>).", **d)
    flags.DEFINE_integer("eval_every", 250, "Held-out greedy accuracy every N steps (0: never).", **d)
    flags.DEFINE_integer("eval_examples", 32, "Validation prompts per periodic eval.", **d)
    flags.DEFINE_integer("eval_batch", 16, "Prompts per generate call.", **d)
    flags.DEFINE_integer("final_eval_examples", 200, "Test prompts per length in the final eval.", **d)
    flags.DEFINE_string("final_eval_lens", "", "Prompt lengths of the final eval (default: the last phase's).", **d)
    flags.DEFINE_integer("checkpoint_every", 100, "Save the resumable state every N steps.", **d)
    flags.DEFINE_integer("log_every", 20, "Log metrics every N steps.", **d)
    flags.DEFINE_bool("eval_only", False, "Only evaluate the exported OUT_DIR model (test split, final_eval_lens).", **d)
    flags.DEFINE_float("eval_temperature", 0.0, "eval_only: 0 = greedy; else top-p 0.95 / top-k 20 sampling.", **d)
    flags.DEFINE_enum("export_dtype", "float32", ["float32", "bfloat16"], "Dtype of the exported weights.", **d)


def config_from_flags(f: flags.FlagValues = FLAGS) -> PretrainConfig:
    offsets = tuple(int(x) for x in f.offset_heads.split(",") if x.strip())
    model = Qwen3Config(
        vocab_size=len(VOCAB), hidden_size=f.hidden_size, intermediate_size=f.intermediate_size,
        num_hidden_layers=f.num_layers, num_attention_heads=f.num_heads, num_key_value_heads=f.num_kv_heads,
        head_dim=f.head_dim, rope_theta=f.rope_theta, tie_word_embeddings=True, attention_bias=bool(offsets),
        max_position_embeddings=f.max_position_embeddings, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    phases = parse_curriculum(f.curriculum, f.batch)
    lens = tuple(int(x) for x in f.final_eval_lens.split(",") if x.strip()) or (phases[-1].prompt_len,)
    return PretrainConfig(
        model=model, phases=phases, run_dir=f.run_dir, out_dir=f.out_dir, difficulty=f.difficulty, seed=f.seed,
        lr=f.lr, final_lr=f.final_lr, warmup_steps=f.warmup_steps, weight_decay=f.weight_decay, b1=f.b1, b2=f.b2,
        clip_norm=f.clip_norm, prompt_weight=f.prompt_weight, completion_weight=f.completion_weight,
        eval_every=f.eval_every, eval_examples=f.eval_examples, eval_batch=f.eval_batch,
        final_eval_examples=f.final_eval_examples, final_eval_lens=lens, checkpoint_every=f.checkpoint_every,
        log_every=f.log_every, export_dtype=f.export_dtype, offset_heads=offsets,
        lookup_circuit=f.lookup_circuit)


def main(argv):
    del argv
    cfg = config_from_flags()
    if FLAGS.eval_only:
        from kvpop_jax import load_pretrained

        model_config, params = load_pretrained(cfg.out_dir)
        sampling = None if FLAGS.eval_temperature == 0 else SamplingConfig(FLAGS.eval_temperature, 0.95, 20, 0.0)
        final_eval(dataclasses.replace(cfg, model=model_config), params, sampling)
        return
    n_params = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))))
    print(f"demo teacher: {n_params:,} params, {cfg.total_steps} steps in {len(cfg.phases)} phases")
    state, records = train(cfg)
    train_seconds = next((r["elapsed_s"] for r in reversed(records) if "elapsed_s" in r), None)
    results = final_eval(cfg, state.params)
    command = "python -m train.pretrain " + " ".join(sys.argv[1:])
    export(cfg, state.params, results, command, train_seconds)
    print(f"exported to {cfg.out_dir}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
