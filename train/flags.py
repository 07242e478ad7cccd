"""Every flag of `python -m train.main`, declared in one place.

`define_flags(flag_values)` declares them; `train/configure.py` maps the parsed values onto the
run configuration (`train/config.py`) and validates them. Besides, `train/main.py` reads --distributed
(before any device is touched) and a few flags for its messages; `train/export.py` and
`train/throughput.py` declare their own.

Model sources (`--init_checkpoint`):
  - a HF Qwen3 directory (config.json + safetensors, plus its tokenizer);
  - `random:NAME` or `random:PATH.json`: a random dense Qwen3 built on the fly (NAME is a
    file `configs/models/NAME.json`; `random:tiny` is the CPU demo model, vocab 128 with the
    demo tokenizer). It is saved to RUN_DIR/init/ and then loaded like a real checkpoint.
`--model_config` gives the architecture without weights (what `--dry_run` needs).

Data (`--data`): a hub dataset name, a local jsonl/parquet/arrow file, directory or glob
(see `kvpop_jax/documents.py`), or `demo:N` = N generated demo-task traces (`demo/task.py`)
written to RUN_DIR/data/demo_train_{N}x{demo_seq_len}_seed{seed}.jsonl.
"""

from __future__ import annotations

from absl import flags

from kvpop_jax.config import (AGGREGATIONS, FEATURE_MAPS, MLSTM_INITS, MLSTM_VALUES, NORMALIZERS, RANK_PARTNERS,
                              RETENTION_LABELS, SCORER_KEYS, SCORER_POSITIONS, SCORERS, TARGET_REDUCTIONS)
from kvpop_jax.modeling import REMAT_POLICIES
from train.config import DTYPES, RETROFITS, VARIANTS


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
    """Declares every training flag on `fv` (tests pass their own FlagValues)."""
    d = dict(flag_values=fv)
    # --- run and model
    flags.DEFINE_string("run_dir", None, "Output directory: checkpoints/, metrics.jsonl, tb/, export/.", **d)
    flags.DEFINE_string("init_checkpoint", None,
                        "HF Qwen3 directory, or random:NAME / random:PATH.json for a random model.", **d)
    flags.DEFINE_string("model_config", None,
                        "config.json of the architecture (needed by --dry_run without weights).", **d)
    flags.DEFINE_string("tokenizer", None, "Tokenizer directory (default: the init checkpoint).", **d)
    flags.DEFINE_integer("seed", 0, "Seed of scorer init, query sampling and data shuffle.", **d)
    # --- KVpop
    flags.DEFINE_integer("sinks", 4, "s: sink tokens.", **d)
    flags.DEFINE_integer("window", 256, "w: protected recent window.", **d)
    flags.DEFINE_integer("topk", 2016, "k: long-range budget (0: StreamingLLM+, a fixed pattern).", **d)
    flags.DEFINE_enum("scorer", "mlstm", SCORERS, "Importance scorer.", **d)
    flags.DEFINE_integer("scorer_hidden", 64, "MLP scorer hidden width per KV head.", **d)
    flags.DEFINE_enum("scorer_keys", "rotated", list(SCORER_KEYS), "Keys the scorer reads: as cached (RoPE "
                      "applied, the paper's [k; v]) or unrotated (no absolute position; not in the paper).", **d)
    flags.DEFINE_enum("scorer_position", "none", list(SCORER_POSITIONS), "none (the paper) or log: the raw score "
                      "gains a learned a_h * log(1 + t) per KV head, t the token's index (not in the paper).", **d)
    flags.DEFINE_integer("mlstm_dim", None, "mLSTM feature dim d per head (default: head_dim, App. A).", **d)
    flags.DEFINE_enum("mlstm_feature_map", "hedgehog", list(FEATURE_MAPS), "mLSTM feature map (Eq. 37).", **d)
    flags.DEFINE_enum("mlstm_value", "projection", list(MLSTM_VALUES),
                      "mLSTM values: a projection of [k; v] or the cached values themselves (App. E.5).", **d)
    flags.DEFINE_bool("mlstm_skip", False, "Skip connection from the scored token to the score projection (E.5).",
                      **d)
    flags.DEFINE_bool("mlstm_norm", False, "Headwise RMS norm of the mLSTM readout (Eq. 42).", **d)
    flags.DEFINE_enum("mlstm_init", "identity", list(MLSTM_INITS),
                      "mLSTM projections: identity-style from the key/value pathways (E.5) or random.", **d)
    flags.DEFINE_float("mlstm_gate_softcap", 15.0, "Soft-cap of the mLSTM gate pre-activations (0: off).", **d)
    flags.DEFINE_float("gamma_min", 0.999, "Decay min.", **d)
    flags.DEFINE_float("gamma_max", 0.999999, "Decay max.", **d)
    flags.DEFINE_float("loss_temperature", 1.0, "Pairwise (retention) loss temperature τ.", **d)
    flags.DEFINE_enum("retention_labels", "hard", RETENTION_LABELS, "Retention loss labels: the teacher's "
                      "keep/drop (Eq. 7) or the target's own preference sigma(margin / tau) (not in the paper).", **d)
    flags.DEFINE_bool("margin_weighting", True, "Margin weighting of the retention loss (Eq. 23).", **d)
    flags.DEFINE_bool("balance_weighting", True, "Keep/drop balance weighting (Eq. 24).", **d)
    flags.DEFINE_enum("normalizer", "sparse", NORMALIZERS, "LSE of the future-attention target.", **d)
    flags.DEFINE_enum("aggregate", "max", AGGREGATIONS, "GQA aggregation of the target.", **d)
    flags.DEFINE_enum("target_reduce", "sum", TARGET_REDUCTIONS,
                      "Reduction of a key's future attention: sum (the paper's mass, Eq. 2, divided by "
                      "N_t) or max (its strongest single read; not in the paper).", **d)
    flags.DEFINE_integer("target_lookahead", None,
                         "L: only queries up to t + w + L count for key t's target, N_t <= L + 1 (App. B.2; "
                         "default: unbounded).", **d)
    flags.DEFINE_integer("num_query_samples", 256, "Sampled boundary positions per sequence.", **d)
    flags.DEFINE_float("late_bias_fraction", 0.5, "Share of late-biased query samples.", **d)
    flags.DEFINE_enum("rank_partners", "random", RANK_PARTNERS, "Rank-pair partners: random older "
                      "tokens, or the older tokens whose keys are closest to the new token's (experiment).", **d)
    flags.DEFINE_integer("keepset_queries", 0, "At this many of the sampled queries per row, a balanced keep/drop "
                         "loss over every eligible token against the teacher's keep set (not in the paper; 0 = off).", **d)
    flags.DEFINE_integer("rank_pairs", 0, "Per sampled query, pairs of the newly eligible token with random "
                         "older tokens in a soft-label ranking loss (not in the paper; 0 = off).", **d)
    flags.DEFINE_integer("target_head_samples", 0, "Extra boundary samples per head: the leave times of the "
                         "target's top tokens (not in the paper; 0 = off).", **d)
    flags.DEFINE_integer("listwise_queries", 0, "At this many of the sampled queries per row, a listwise KL of "
                         "the student's over the target's softmax(priority / tau) over the eligible tokens "
                         "(not in the paper; 0 = off).", **d)
    flags.DEFINE_float("listwise_temperature", 0.25, "tau of --listwise_queries (small: the target's top).", **d)
    flags.DEFINE_float("regression_weight", 0.0, "Weight of a squared-error fit of every competing token's raw "
                       "score to its log-target, which ranks below the top (not in the paper; 0 = off).", **d)
    flags.DEFINE_float("retention_loss_weight", 1.0, "Weight of the retention loss.", **d)
    flags.DEFINE_integer("kl_topk", 256, "Teacher top-k logits for the KL.", **d)
    flags.DEFINE_float("kl_temperature", 1.0, "KL temperature.", **d)
    # --- DMS (the learned-eviction baseline, kvpop_jax/dms.py): a run with --retrofit=dms or the
    # dms variant, at the memory per KV head of the KVpop flags above
    flags.DEFINE_enum("retrofit", "kvpop", list(RETROFITS),
                      "What a single run trains: kvpop (the KVpop flags) or dms (DMS at the same memory per KV "
                      "head as those flags: window --window, target eviction rate for that mean occupancy at "
                      "--seq_len, gates with the KVpop scorer's parameter count).", **d)
    flags.DEFINE_integer("dms_window", None, "DMS window w (default: --window).", **d)
    flags.DEFINE_float("dms_temperature", 0.1, "Temperature of DMS's Gumbel-sigmoid relaxation.", **d)
    flags.DEFINE_float("dms_ramp_fraction", 0.9,
                       "Share of the steps over which DMS's target compression ratio rises linearly to its final "
                       "value.", **d)
    flags.DEFINE_float("dms_logit_scale", 1.0, "DMS decision logit = scale * gate - offset.", **d)
    flags.DEFINE_float("dms_logit_offset", 5.0, "DMS decision logit offset (the start: -offset).", **d)
    flags.DEFINE_float("dms_aux_loss_weight", 1.0, "Weight of DMS's one-sided eviction-rate loss.", **d)
    # --- data
    flags.DEFINE_string("data", None, "Hub dataset, local file/dir/glob, or demo:N (generated demo traces).", **d)
    flags.DEFINE_string("data_split", "train", "Split (hub names and saved datasets); several, comma-separated, "
                        "are interleaved (e.g. high_part00,high_part01,high_part02).", **d)
    flags.DEFINE_string("data_subset", None, "Hub dataset config name.", **d)
    flags.DEFINE_string("text_field", "auto", "Text field: auto, a column, or a+b.", **d)
    flags.DEFINE_bool("shuffle", True, "Shuffle documents (deterministic in --seed).", **d)
    flags.DEFINE_bool("split_documents", False, "Pack as one continuous stream (documents may be cut).", **d)
    flags.DEFINE_integer("min_length", 2, "Drop documents shorter than this (tokens).", **d)
    flags.DEFINE_integer("max_length", None, "Drop documents longer than this (default: seq_len).", **d)
    flags.DEFINE_bool("streaming", None, "Stream the dataset (default: hub yes, local no).", **d)
    flags.DEFINE_integer("demo_seq_len", 1536, "Prompt length of generated demo traces (demo:N).", **d)
    flags.DEFINE_list("demo_tasks", ["read_once"],
                      "Demo tasks of the generated traces (demo:N), in turn: reuse, read_once (demo/task.py).", **d)
    # --- batch and schedule
    flags.DEFINE_integer("seq_len", 16384, "S: tokens per packed row.", **d)
    flags.DEFINE_integer("global_batch", 128, "Rows per optimizer step (all devices, all micro-batches).", **d)
    flags.DEFINE_integer("micro_batch", None,
                         "Rows per forward/backward (default: global_batch); accumulation = global/micro.", **d)
    flags.DEFINE_integer("steps", 2000, "Optimizer steps.", **d)
    # --- teacher
    flags.DEFINE_enum("teacher_dtype", "auto", ["auto", *DTYPES],
                      "Frozen teacher weights (auto: bfloat16 on GPU/TPU, float32 on CPU).", **d)
    flags.DEFINE_string("teacher_logits_dir", None,
                        "Read precomputed teacher top-k (step_{N:08d}.npz: values, indices [B, S, K]) "
                        "instead of running the teacher.", **d)
    flags.DEFINE_bool("write_teacher_logits", False,
                      "Instead of training, run the teacher over the batches of steps [0, --steps) and "
                      "write their top-k to --teacher_logits_dir (float32 values, int32 indices).", **d)
    # --- optimizer
    flags.DEFINE_float("base_lr", 8e-5, "Constant LR of the base weights.", **d)
    flags.DEFINE_float("new_lr", 1e-3, "Peak LR of new params (scorers, decay).", **d)
    flags.DEFINE_float("new_lr_final", 8e-5, "Final LR of the cosine schedule of new params.", **d)
    flags.DEFINE_integer("warmup_steps", 100, "Linear warmup steps of new params.", **d)
    flags.DEFINE_float("adam_b1", 0.9, "AdamW beta1.", **d)
    flags.DEFINE_float("adam_b2", 0.95, "AdamW beta2.", **d)
    flags.DEFINE_float("adam_eps", 1e-8, "AdamW epsilon.", **d)
    flags.DEFINE_float("weight_decay", 1e-4, "AdamW weight decay (all parameters).", **d)
    flags.DEFINE_float("clip_norm", 1.0, "Global gradient-norm clipping (0: off).", **d)
    flags.DEFINE_bool("freeze_base", False, "Train only scorers and decay (base weights frozen).", **d)
    # --- precision and memory
    flags.DEFINE_enum("param_dtype", "float32", list(DTYPES), "Master weights and optimizer state.", **d)
    flags.DEFINE_enum("compute_dtype", "auto", ["auto", *DTYPES],
                      "Matmul/activation dtype (auto: bfloat16 on GPU/TPU, float32 on CPU).", **d)
    flags.DEFINE_enum("remat", "none", list(REMAT_POLICIES), "Per-layer rematerialization policy.", **d)
    flags.DEFINE_bool("scan_layers", False,
                      "Run the decoder layers as one lax.scan in the train step: XLA compiles one layer instead "
                      "of all (Qwen3-8B: 36). Same parameters, checkpoints and math (float rounding aside); costs "
                      "one more copy of both models' layer weights during the step (the stack the scan reads).", **d)
    flags.DEFINE_integer("loss_chunk", 0,
                         "Compute lm_head + KL over sequence chunks of this many tokens (0: whole "
                         "sequence); avoids [B, S, V] logits.", **d)
    # --- mesh
    flags.DEFINE_integer("mesh_data", 1, "Data-parallel mesh axis (-1: the remaining devices).", **d)
    flags.DEFINE_integer("mesh_fsdp", -1, "FSDP mesh axis (-1: the remaining devices).", **d)
    flags.DEFINE_integer("mesh_tensor", 1, "Tensor-parallel mesh axis.", **d)
    flags.DEFINE_enum("distributed", "auto", ("auto", "on", "off"),
                      "jax.distributed.initialize(): auto = when a multi-host environment is detected.", **d)
    # --- checkpoints, export, logging
    flags.DEFINE_integer("checkpoint_every", 500, "Save a checkpoint every N steps (and at the end).", **d)
    flags.DEFINE_integer("keep_checkpoints", 3, "Checkpoints kept (older ones deleted).", **d)
    flags.DEFINE_bool("async_checkpointing", True, "Write checkpoints in the background.", **d)
    flags.DEFINE_bool("resume", True,
                      "Resume from the latest checkpoint in run_dir/checkpoints (refused if a budget, scorer, "
                      "width, sequence length or model flag changed since).", **d)
    flags.DEFINE_bool("overwrite", False,
                      "Start over in a run_dir that holds a run: delete its checkpoints, metrics.jsonl, tb/ and "
                      "train_config.json first (without it, --noresume there is refused).", **d)
    flags.DEFINE_bool("export", True, "Export HF-style safetensors to --export_dir at the end.", **d)
    flags.DEFINE_string("export_dir", None, "Export directory (default: run_dir/export).", **d)
    flags.DEFINE_integer("log_every", 1, "Write metrics every N steps.", **d)
    flags.DEFINE_float("divergence_factor", 100.0,
                       "Stop (without saving) when kl, retention_loss or loss exceeds this multiple of its running "
                       "median (0: off).", **d)
    flags.DEFINE_integer("divergence_warmup", 3, "Steps of history the divergence guard needs before it checks.", **d)
    flags.DEFINE_bool("tensorboard", True, "Also write TensorBoard events to run_dir/tb.", **d)
    flags.DEFINE_bool("progress", True, "tqdm progress bar.", **d)
    # --- recipe: several retrofits of one teacher, then the demo comparison (train/recipe.py)
    flags.DEFINE_list("variants", [],
                      "Train these retrofits one after another, each into RUN_DIR/NAME with the flags above "
                      f"except: {', '.join(VARIANTS)} (StreamingLLM+: k = 0, w = --window + --topk, same B; "
                      "dms: see --retrofit). "
                      "Empty: one run into RUN_DIR exactly as the flags say.", **d)
    flags.DEFINE_list("eval_methods", [],
                      "After training, pass@1 on held-out demo-task problems for these methods: dense, "
                      "streaming, tova, h2o (the init checkpoint with a training-free cache) and any of "
                      "--variants (their exports). Empty: no evaluation.", **d)
    flags.DEFINE_integer("eval_problems", 100, "Held-out demo problems (test split) for --eval_methods.", **d)
    flags.DEFINE_list("eval_crs", ["0.75", "0.88"], "Compression ratios: B = (1 - CR) * --eval_prompt_len.", **d)
    flags.DEFINE_integer("eval_prompt_len", 1024, "Prompt length of the held-out demo problems (tokens).", **d)
    flags.DEFINE_integer("eval_batch", 50, "Problems decoded per batch (greedy, one rollout each).", **d)
    flags.DEFINE_integer("eval_recall_sequences", 8,
                         "Held-out traces for the teacher-retention recall of each KVpop variant and for DMS's "
                         "eviction patterns (0: skip both).", **d)
    flags.DEFINE_list("eval_tasks", ["read_once"],
                      "Demo tasks to evaluate on, each with its own table; the first is the main task the "
                      "targets are checked on.", **d)
    flags.DEFINE_integer("eval_long_len", 0,
                         "Also evaluate dense and --eval_long_methods at this prompt length on the main task, "
                         "at the same budgets B (length generalization; 0: skip).", **d)
    flags.DEFINE_bool("eval_stream_prompt", True,
                      "StreamingLLM, TOVA and H2O read the demo prompt token by token, evicting as they go, as "
                      "over a generated reasoning trace (the demo's trace is its prompt; KVpop and DMS do so by "
                      "construction). --noeval_stream_prompt: one-shot compression after a dense prefill, "
                      "which lets them see every read in the prompt before deciding.", **d)
    flags.DEFINE_list("eval_long_methods", ["kvpop-mlstm", "kvpop-mlp"],
                      "The trained variants evaluated at --eval_long_len (each in --eval_methods; the default: "
                      "those of the two that run).", **d)
    flags.DEFINE_bool("quick", False,
                      "A faster, rougher run into RUN_DIR-quick: a quarter of --steps (and of --warmup_steps, "
                      "--checkpoint_every and --eval_problems), exported into RUN_DIR-quick/export (an "
                      "--export_dir is refused: it would replace a full run's export).", **d)
    flags.DEFINE_bool("dry_run", False,
                      "Compile the train step for the real shapes on abstract arrays, print per-device "
                      "memory, and exit (no weights or data needed).", **d)
