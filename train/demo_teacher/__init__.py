"""Pretrains the demo teacher: a tiny dense Qwen3 trained from scratch on the demo task.

This package: `config.py` (the run's settings), `data.py` (batches), `init.py` (the planted
circuit), `loop.py` (train step, resumable state, the loop), `evaluate.py` (accuracy, export)
and `main.py` (flags); `python -m train.pretrain` runs `main`.

    python -m train.pretrain --flagfile=configs/tiny_teacher.flags            # train + export
    python -m train.pretrain --flagfile=configs/tiny_teacher.flags --eval_only  # re-measure

Data (`train/demo_teacher/data.py`): demo-task traces (`demo/task.py`) generated on the fly,
deterministic by (seed, step), one whole `<bos> prompt completion <eos>` trace per row.

Init (`--offset_heads`, `--lookup_circuit`, `train/demo_teacher/init.py`): a plain model sits on
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
validation accuracy every `eval_every` steps), and OUT_DIR (`train/demo_teacher/evaluate.py`:
save_pretrained + the demo tokenizer + eval.json + README.md model card) with test-split
accuracy at each of `final_eval_lens`.
"""
