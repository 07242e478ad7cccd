"""The demo teacher's run settings: model, curriculum phases, optimizer, evaluation and export."""

from __future__ import annotations

import dataclasses
import json

from demo import task as demo_task
from demo.atoms import VOCAB
from kvpop_jax.config import Qwen3Config
from train.demo_teacher.data import MAX_BATCH, Phase, reuse_rows

# A phase's overrides that are not demo-task fields: shares of drill / reuse rows, the parking weight, and (the last
# two, `demo.task.make_config`'s presets) the phase's difficulty and task
PHASE_OVERRIDES = ("drill", "lookup", "recall", "reuse", "park", "difficulty", "task")


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
    lookup_circuit: bool = False  # plant the name -> digit lookup circuit (train/demo_teacher/init.py)
    recall_head: bool = False  # plant the recall head too (reads `q=4` lines: the recall drills)
    init_from: str = ""  # start from this exported teacher's weights (HF dir) instead of a fresh init
    park_weight: float = 0.0  # weight of the parking loss (`data.park_mask`, `loop.park_loss`); 0: off
    park_window: int = 32  # parking loss: keys older than this many tokens count as a read
    park_lookups: bool = False  # parking loss: at a lookup too, every head's old attention but the layer's largest
    park_queries: str = "names"  # parked queries: "names" (binding names) or "all" (every prompt query but the lookups)

    def __post_init__(self):
        if not self.phases:
            raise ValueError("the curriculum needs at least one phase")
        for name in ("eval_batch", "final_eval_examples", "log_every", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.eval_every < 0 or (self.eval_every and self.eval_examples < 1):
            raise ValueError(f"eval_every={self.eval_every}, eval_examples={self.eval_examples}: need eval_every >= 0 "
                             "(0: never) and eval_examples >= 1 when it evaluates")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        for p in self.phases:
            if p.steps < 1 or not 1 <= p.batch <= MAX_BATCH:
                raise ValueError(f"phase {p}: need steps >= 1 and 1 <= batch <= {MAX_BATCH}")
            shares = {k: v for k, v in p.task if k in ("drill", "lookup", "recall", "reuse")}
            for k, v in shares.items():
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                    raise ValueError(f"phase {p}: {k}={v!r} must be a share of the batch in [0, 1]")
            drills = sum(round(shares.get(k, 0.0) * p.batch) for k in ("drill", "lookup", "recall"))
            if drills >= p.batch:  # completion metrics would be 0/0
                raise ValueError(f"phase {p}: drill, lookup and recall rows take all {p.batch} rows; leave some for "
                                 "the task")
            if "seq_len" in dict(p.task):
                raise ValueError(f"phase {p}: seq_len is the phase's LEN, not an override")
            known = PHASE_OVERRIDES + tuple(f.name for f in dataclasses.fields(demo_task.DemoTaskConfig)
                                            if f.name != "seq_len")
            unknown = [k for k, _ in p.task if k not in known]
            if unknown:  # was a TypeError from DemoTaskConfig, with a traceback
                raise ValueError(f"phase {p}: unknown override {unknown[0]!r}; known: {', '.join(known)}")
            park = dict(p.task).get("park", 0.0)  # park_weight_of's override, checked before step 0
            if not isinstance(park, (int, float)) or park < 0:
                raise ValueError(f"phase {p}: park={park!r} must be a parking-loss weight >= 0")
            task = self.task(p)  # validates the length and the overrides
            try:
                reuse_rows(p, task)  # and the reuse rows make_batch would build, before step 0
            except ValueError as e:
                raise ValueError(f"phase {p}: reuse rows at {p.prompt_len} tokens: {e}") from None
        if self.difficulty not in demo_task.DIFFICULTY:
            raise ValueError(f"difficulty must be one of {sorted(demo_task.DIFFICULTY)}, got {self.difficulty!r}")
        for length in self.final_eval_lens:  # read_once at every length; reuse where it fits (said in the card)
            try:
                demo_task.make_config(self.difficulty, seq_len=length)
            except ValueError as e:
                raise ValueError(f"final_eval_lens holds {length}: {e}") from None
        if self.model.vocab_size < len(VOCAB):
            raise ValueError(f"vocab_size={self.model.vocab_size} < the demo tokenizer's {len(VOCAB)}")
        if self.export_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"export_dtype must be float32 or bfloat16, got {self.export_dtype!r}")
        if self.offset_heads and not self.model.attention_bias:
            raise ValueError("offset_heads needs a model with attention_bias=True (the heads are q/k biases)")
        if self.init_from and (self.lookup_circuit or self.offset_heads):
            raise ValueError(f"init_from={self.init_from!r} starts from trained weights: drop lookup_circuit / "
                             "offset_heads (they only shape a fresh init)")
        if self.park_weight < 0 or self.park_window < 1:
            raise ValueError(f"park_weight={self.park_weight}, park_window={self.park_window}: need a weight >= 0 "
                             "and a window >= 1")
        if self.recall_head and not self.lookup_circuit:
            raise ValueError("recall_head is part of the planted lookup circuit: it needs lookup_circuit")
        if self.lookup_circuit and self.offset_heads[:1] != (1,):
            raise ValueError("lookup_circuit needs offset_heads to start with 1 (its previous-token head)")
        if len(self.offset_heads) > self.model.num_key_value_heads or any(o < 1 for o in self.offset_heads):
            raise ValueError(f"offset_heads={self.offset_heads}: at most one offset >= 1 per KV head "
                             f"({self.model.num_key_value_heads})")

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)

    def park_weight_of(self, phase: Phase) -> float:
        """The parking loss's weight in a phase: its `park=W` override, else `park_weight`."""
        return float(dict(phase.task).get("park", self.park_weight))

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
        for drill in PHASE_OVERRIDES[:-2]:  # not task fields: shares of drill / reuse rows, the phase's parking
            overrides.pop(drill, None)     # weight
        difficulty = overrides.pop("difficulty", self.difficulty)
        return demo_task.make_config(difficulty, seq_len=phase.prompt_len, **overrides)

    def resume_key(self) -> dict:
        """The settings a resumed run must share with the saved one."""
        keys = ("phases", "difficulty", "seed", "lr", "final_lr", "warmup_steps", "weight_decay", "b1", "b2",
                "clip_norm", "prompt_weight", "completion_weight", "offset_heads", "lookup_circuit", "recall_head",
                "init_from", "park_weight", "park_window", "park_queries", "park_lookups")
        return json.loads(json.dumps(dict(model=self.model.to_hf(),  # phases' tuples become lists
                                          **{k: dataclasses.asdict(self)[k] for k in keys})))
