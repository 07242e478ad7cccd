"""`python -m eval.main <command> [--flags]`: generation, evaluation and benchmarks.

Commands (each prints its own `--help`):
  generate        sample a continuation of a prompt from a HF-format checkpoint directory
  accuracy        pass@1 over sampled rollouts: methods x compression ratios (paper Table 1)
  recall          per layer/head recall of the teacher's top-k by the learned scorer (Fig. 7)
  patterns        retention heat map (layers x tokens) and per-head long-range usage (Fig. 6); for a
                  DMS export the per-head eviction ratio heat map and occupancy (App. H, Fig. 8)
  bench kernels   time the Pallas kernels vs their XLA references and dense attention
  bench decode    per-token latency and memory vs generated length (Fig. 4)
  bench train     a training step per variant and each KVpop layer part, as ratios to dense
  bench gpu       on a GPU node: kernel tests, kernels, decode, the 8B recipe's dry run, tokens/s and MFU
  diagnose        why a demo retrofit keeps (or loses) the facts it needs (eval/diagnose.py)

accuracy, recall, patterns and bench decode / train / gpu write a markdown table and PNG plots to
--out_dir; bench kernels appends to --out_md, diagnose to --out, and generate prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eval import bench_decode, bench_gpu, bench_kernels, bench_train, diagnose
from eval.accuracy import parse_checkpoints, run_accuracy
from eval.dms_patterns import run_dms_patterns
from eval.outputs import out_dir_arg
from eval.patterns import run_patterns
from eval.recall import ROWS, run_recall
from kvpop_jax import load_pretrained
from kvpop_jax.baselines import BOUNDED_METHODS as BASELINES
from kvpop_jax.checkpoint import chat_prompt_ids, checkpoint_tokenizer, load_tokenizer, stop_token_ids
from kvpop_jax.generate import check_seed, generate
from kvpop_jax.config import Qwen3Config
from kvpop_jax.modeling import Qwen3ForCausalLM, check_token_ids
from kvpop_jax.runtime import (exit_at_once_on_interrupt, interrupt_outside_gc_callbacks, out_of_memory,
                               report_backend)
from kvpop_jax.sampling import SamplingConfig


def cmd_generate(argv: Sequence[str]) -> None:
    """Samples a continuation of a prompt from a HF-format checkpoint (dense or KVpop)."""
    parser = argparse.ArgumentParser(prog="python -m eval.main generate", description=cmd_generate.__doc__)
    parser.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", default=None, help="prompt text (uses the checkpoint's tokenizer)")
    prompt.add_argument("--prompt_file", default=None,
                        help="a UTF-8 file holding the prompt text (longer than one shell argument may be)")
    prompt.add_argument("--prompt_ids", default=None, help="comma-separated token ids (no tokenizer needed)")
    parser.add_argument("--chat_template", action="store_true",
                        help="the prompt text as one user turn of the tokenizer's chat template")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--top_k", type=int, default=20, help="0 = off")
    parser.add_argument("--min_p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config = Qwen3Config.from_hf(args.checkpoint)  # cheap: bad ids fail before the weights load
    tokenizer = None
    if args.prompt_ids is not None:
        if args.chat_template:
            parser.error("--chat_template needs --prompt or --prompt_file (the text it wraps), not --prompt_ids")
        ids = parse_token_ids(args.prompt_ids, "--prompt_ids")
        check_token_ids(ids, config.vocab_size, f"--prompt_ids (for {args.checkpoint})")
    else:
        try:
            tokenizer = load_tokenizer(args.checkpoint)
        except ValueError as e:
            parser.error(f"{e}; pass --prompt_ids instead of --prompt")
        if args.prompt_file is not None:
            text = _read_text(args.prompt_file, "--prompt_file")
        else:
            text = _utf8_arg(args.prompt, "--prompt")
        if not args.chat_template:
            ids = tokenizer(text)["input_ids"]
        elif not getattr(tokenizer, "chat_template", None):
            parser.error(f"--chat_template: the tokenizer in {args.checkpoint} has no chat template")
        else:
            ids = chat_prompt_ids(tokenizer, text)
    if not ids:
        parser.error("the prompt is empty")
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.min_p)  # checked before the weights
    seed = check_seed(args.seed, "--seed")
    config, params = load_pretrained(args.checkpoint)
    eos_ids = stop_token_ids(args.checkpoint, config)
    tokens, lengths = generate(
        Qwen3ForCausalLM(config), params, jnp.asarray([ids]), max_new_tokens=args.max_new_tokens,
        sampling=sampling, eos_ids=eos_ids, rng=seed,
    )
    out = np.asarray(tokens[0, : int(lengths[0])]).tolist()
    kind = (f"KVpop (bounded cache: s + w + k = {config.kvpop.budget} slots, memory B = "
            f"{config.kvpop.memory(config.head_dim)} entries per KV head)" if config.kvpop else
            "DMS (bounded pool, %d entries per KV head)" % config.dms.budget if config.dms else "dense")
    print(f"model: {kind}")
    print("prompt ids:", ids)
    print("generated ids:", out)
    if tokenizer is not None:
        print("generated text:", tokenizer.decode(out))


def parse_token_ids(text: str, flag: str) -> list[int]:
    """'1,5,9' -> [1, 5, 9]; anything else is a ValueError naming the flag and the bad item."""
    ids = []
    for item in text.split(","):
        try:
            ids.append(int(item.strip()))
        except ValueError:
            raise ValueError(f"{flag}: {item.strip()!r} is not an integer token id (want e.g. 1,5,9)") from None
    return ids


def _items(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']: a space after a comma is not part of a method or benchmark name (it sent
    ' demo:reuse' to the hub as a dataset name), as --checkpoints already reads it."""
    return [item.strip() for item in text.split(",") if item.strip()]


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers (e.g. 0.75,0.88)") from None


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints (e.g. 2309,4325)") from None


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help with each option's default where it has one (not None, not a switch's, not a required option's)."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        shown = action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, bool) \
            and not action.required
        return help_text + (" (default: %(default)s)" if shown and "%(default)" not in help_text else "")


def cmd_accuracy(argv: Sequence[str]) -> None:
    """pass@1 of dense, training-free baselines and KVpop checkpoints on a benchmark."""
    parser = argparse.ArgumentParser(prog="python -m eval.main accuracy", description=cmd_accuracy.__doc__,
                                     formatter_class=DefaultsHelpFormatter)  # the paper's settings, shown
    parser.add_argument("--checkpoints", required=True,
                        help="NAME=DIR[,NAME@CR=DIR | NAME@B=DIR (with --budgets)...]; 'dense' serves "
                             "dense/streaming/tova/h2o, other names are KVpop or DMS exports (e.g. "
                             "kvpop-mlp=runs/x/export)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated: dense, streaming, tova, h2o (on the dense checkpoint) and the KVpop or "
                             "DMS exports by their names in --checkpoints (default: every export given, after dense "
                             "and the three baselines when dense is given)")
    parser.add_argument("--benchmark", required=True,
                        help="comma-separated: JSONL/JSON/parquet/csv files, hub dataset names, or generated demo "
                             "problems demo:TASK[:SPLIT][:seed=S][:n=N][:len=L][:difficulty=D], e.g. "
                             "demo:reuse:test:seed=123:n=100:len=2048 (--context_len is the length the CRs are taken "
                             "of: L for that prompt length's budgets, or e.g. 1024 to keep the budgets of 1024 "
                             "tokens)")
    parser.add_argument("--n_rollouts", type=int, default=16, help="sampled completions per problem (the paper's "
                        "pass@1 over 16; 1 with --temperature 0: greedy)")
    parser.add_argument("--compression_ratios", type=_floats, default=None,
                        help="comma-separated CRs, each run at memory B = round((1 - CR) * context_len) per KV head "
                             "(default 0.75,0.88)")
    parser.add_argument("--budgets", type=_ints, default=None,
                        help="comma-separated memories B per KV head instead of CRs, each run at CR 1 - B / "
                             "context_len: e.g. an export's trained memory (2309 and 4325 for the Qwen3 CR 88%% and "
                             "75%% recipes, whose B is not round((1 - CR) * 16384)); NAME@B=DIR gives a checkpoint "
                             "per budget")
    parser.add_argument("--context_len", type=int, default=16384,
                        help="CR = 1 - B / context_len (the paper's 16384; the prompt length for demo problems)")
    parser.add_argument("--max_new_tokens", type=int, default=4096, help="tokens per completion at most")
    parser.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    parser.add_argument("--top_p", type=float, default=0.95, help="nucleus sampling")
    parser.add_argument("--top_k", type=int, default=20, help="0: off")
    parser.add_argument("--min_p", type=float, default=0.0, help="0: off")
    parser.add_argument("--sinks", type=int, default=4, help="StreamingLLM's sink tokens (TOVA and H2O run without)")
    parser.add_argument("--limit", type=int, default=None, help="first N >= 1 problems only")
    parser.add_argument("--split", default=None,
                        help="local folders and hub datasets: the split (default test); a demo spec names its own")
    parser.add_argument("--chat_template", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="the sampling's")
    parser.add_argument("--problem_batch", type=int, default=1,
                        help="with --n_rollouts=1: decode up to this many problems of equal prompt length per batch "
                             "(consecutive or not)")
    parser.add_argument("--stream_prompt", action="store_true",
                        help="training-free baselines read the prompt token by token (evict as over a generated "
                             "trace) instead of compressing it in one shot after a dense prefill")
    parser.add_argument("--no_compile_ahead", dest="compile_ahead", action="store_false",
                        help="compile each method x CR's decode when it starts, not in a worker thread while the one "
                             "before decodes (the same completions either way)")
    parser.add_argument("--noresume", dest="resume", action="store_false",
                        help="decode every method x CR again, even those a killed run into --out_dir finished with "
                             "the same inputs (kept in OUT/.accuracy-journal.jsonl; by default only the rest run)")
    parser.add_argument("--out_dir", required=True, type=out_dir_arg)
    args = parser.parse_args(argv)
    checkpoints = parse_checkpoints(args.checkpoints)
    exports = [name for name in checkpoints if name != "dense"]
    if args.methods is None:  # the default once left out every export given, and ran the baselines alone
        methods = (["dense", *BASELINES] if "dense" in checkpoints else []) + exports
    else:
        methods = _items(args.methods)
        left_out = [name for name in exports if name not in methods]
        if left_out:
            print(f"note: --checkpoints gives {', '.join(left_out)}, which --methods {args.methods!r} leaves out: "
                  "not run", file=sys.stderr)
    run_accuracy(
        methods, checkpoints, _items(args.benchmark), n_rollouts=args.n_rollouts,
        compression_ratios=args.compression_ratios, context_len=args.context_len, budgets=args.budgets,
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(args.temperature, args.top_p, args.top_k, args.min_p), out_dir=args.out_dir,
        sinks=args.sinks, limit=args.limit, split=args.split, chat_template=args.chat_template, seed=args.seed,
        problem_batch=args.problem_batch, stream_prompt=args.stream_prompt, compile_ahead=args.compile_ahead,
        resume=args.resume,
    )
    print(open(f"{args.out_dir}/accuracy.md").read())


TEXT_FIELD_HELP = ("the text column of a dataset of texts (auto: text, content, ... or chat messages); "
                   "token-id JSONL needs none")


def cmd_recall(argv: Sequence[str]) -> None:
    """Teacher top-k retention recall per layer/head, plus token accuracy."""
    parser = argparse.ArgumentParser(prog="python -m eval.main recall", description=cmd_recall.__doc__)
    parser.add_argument("--checkpoint", required=True, help="KVpop checkpoint directory")
    parser.add_argument("--data", required=True, help="JSONL of texts or token ids")
    parser.add_argument("--teacher", default=None, help="dense checkpoint for argmax agreement")
    parser.add_argument("--num_sequences", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=None, help="default 2 x (s + w + k)")
    parser.add_argument("--num_queries", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=None,
                        help="memory per KV head B to measure at (k = B - s - w - scorer state); default the "
                             "checkpoint's own (the paper's Fig. 7: B = 0.25 x seq_len, CR 75%%)")
    parser.add_argument("--rows", default="stream", choices=ROWS,
                        help="stream: documents concatenated and cut into rows (long text, as training packs it); "
                             "documents: one row per document of >= seq_len tokens, its first seq_len (problems, "
                             "as they are run)")
    parser.add_argument("--text_field", default="auto", help=TEXT_FIELD_HELP)
    parser.add_argument("--out_dir", required=True, type=out_dir_arg)
    args = parser.parse_args(argv)
    run_recall(args.checkpoint, args.data, num_sequences=args.num_sequences, seq_len=args.seq_len,
               num_queries=args.num_queries, out_dir=args.out_dir, teacher=args.teacher, seed=args.seed,
               budget=args.budget, rows=args.rows, text_field=args.text_field)
    print(open(f"{args.out_dir}/recall.md").read())


def cmd_patterns(argv: Sequence[str]) -> None:
    """Which tokens each layer keeps (heat map) and how each head uses its k slots; for a DMS export,
    the median eviction ratio per layer and KV head and the occupancy (eval/dms_patterns.py)."""
    parser = argparse.ArgumentParser(prog="python -m eval.main patterns", description=cmd_patterns.__doc__)
    parser.add_argument("--checkpoint", required=True, help="KVpop or DMS checkpoint directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text, tokenized with the checkpoint's tokenizer")
    src.add_argument("--text_file", help="file holding the text")
    src.add_argument("--ids", help="comma-separated token ids")
    src.add_argument("--data", help="DMS only: rows of a dataset (JSONL of ids or text), the median over rows")
    parser.add_argument("--num_sequences", type=int, default=None, help="--data: rows (default 100)")
    parser.add_argument("--seq_len", type=int, default=None, help="DMS only: tokens per row")
    parser.add_argument("--rows", default=None, choices=ROWS,
                        help="--data: stream (documents concatenated and cut into rows; the default) or documents "
                             "(one row per document of >= seq_len tokens, its first seq_len: problems as they are "
                             "run)")
    parser.add_argument("--text_field", default=None, help="--data: " + TEXT_FIELD_HELP + " (default auto)")
    parser.add_argument("--last_n", type=int, default=None, help="KVpop only: evictable tokens in the heat map "
                        "(default 112)")
    parser.add_argument("--out_dir", required=True, type=out_dir_arg)
    args = parser.parse_args(argv)
    config = Qwen3Config.from_hf(args.checkpoint)
    # options another kind of export or input would ignore, named (they were dropped without a word)
    unused = ["num_sequences", "seq_len", "rows", "text_field"] if config.dms is None else \
        [] if args.data else ["num_sequences", "rows", "text_field"]
    given = [f"--{name}" for name in unused if getattr(args, name) is not None]
    if given:
        parser.error(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for "
                     + ("--data (rows of a dataset)" if config.dms is not None else
                        "DMS exports; a KVpop export reports the one sequence of --text, --text_file or --ids"))
    if config.dms is not None:
        if args.last_n is not None:  # the DMS report has no heat map over the last tokens: it was ignored
            parser.error(f"--last_n={args.last_n} is for KVpop exports (the heat map of the last tokens); a DMS "
                         "export reports its eviction ratios over whole rows (--seq_len)")
        if args.data:
            data = args.data
        elif args.ids:
            data = np.asarray([parse_token_ids(args.ids, "--ids")])
            check_token_ids(data, config.vocab_size, f"--ids (for {args.checkpoint})")
        else:
            tokenizer = checkpoint_tokenizer(args.checkpoint)
            if tokenizer is None:
                parser.error(f"no tokenizer in {args.checkpoint!r}; pass --ids or --data")
            text = _read_text(args.text_file) if args.text_file else _utf8_arg(args.text, "--text")
            data = np.asarray([tokenizer(text)["input_ids"]])
        run_dms_patterns(args.checkpoint, data, num_sequences=100 if args.num_sequences is None else args.num_sequences,
                         seq_len=args.seq_len, out_dir=args.out_dir, rows=args.rows or "stream",
                         text_field=args.text_field or "auto")
        print(open(f"{args.out_dir}/dms_patterns.md").read())
        return
    if args.data:
        parser.error("--data is for DMS exports; pass --text, --text_file or --ids for a KVpop export")
    if args.ids:
        source = parse_token_ids(args.ids, "--ids")
    elif args.text_file:
        source = _read_text(args.text_file)
    else:
        source = _utf8_arg(args.text, "--text")
    run_patterns(args.checkpoint, source, out_dir=args.out_dir, last_n=112 if args.last_n is None else args.last_n)
    print(open(f"{args.out_dir}/patterns.md").read())


def cmd_bench(argv: Sequence[str]) -> None:
    """Benchmarks: kernels, decode, train, gpu (all of a GPU node's first measurements in one run)."""
    benches: dict[str, Callable[[Sequence[str]], None]] = {
        "kernels": bench_kernels.main,
        "decode": bench_decode.main,
        "train": bench_train.main,
        "gpu": bench_gpu.main,
    }
    usage = f"usage: python -m eval.main bench {{{'|'.join(benches)}}} [--flags]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{cmd_bench.__doc__}")
        return
    if not argv or argv[0] not in benches:
        _usage_error(usage, f"bench wants one of {', '.join(benches)}, got {_first_word(argv)}")
    benches[argv[0]](argv[1:])


COMMANDS: dict[str, Callable[[Sequence[str]], None]] = {
    "generate": cmd_generate,
    "accuracy": cmd_accuracy,
    "recall": cmd_recall,
    "patterns": cmd_patterns,
    "bench": cmd_bench,
    "diagnose": diagnose.main,
}


def _read_text(path: str, flag: str = "--text_file") -> str:
    """The text of a file flag; a file that is not UTF-8 is named (not a bare codec error)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except FileNotFoundError:  # was the bare "[Errno 2] No such file or directory: 'nope.txt'"
        raise ValueError(f"{flag} {path!r}: no such file") from None
    except IsADirectoryError:
        raise ValueError(f"{flag} {path!r} is a folder; expected a text file") from None
    except PermissionError:
        raise ValueError(f"{flag} {path!r}: no permission to read it") from None


def _utf8_arg(text: str, flag: str) -> str:
    """A text flag as given; bytes of it that are not UTF-8 reach Python as lone surrogates (PEP 383), which
    the tokenizer refuses with a bare TypeError, so they are named here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start])
        what = f"byte {bad - 0xDC00:#04x}" if 0xDC80 <= bad <= 0xDCFF else f"lone surrogate {chr(bad)!r}"
        raise ValueError(f"{flag} is not UTF-8 text ({what} at character {e.start})") from None
    return text


def _first_word(argv: Sequence[str]) -> str:
    return repr(argv[0]) if argv else "none"


def _usage_error(usage: str, message: str) -> None:
    """A missing or unknown (sub)command: the usage, then one `error:` line, exit 2 (as every bad input)."""
    print(usage, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


# What a user's input can raise (missing or malformed files, bad values): one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    usage = f"usage: python -m eval.main {{{'|'.join(COMMANDS)}}} ... [--flags]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return
    if not argv or argv[0] not in COMMANDS:
        _usage_error(f"{usage}\n\n{__doc__}",
                     f"the command must be one of {', '.join(COMMANDS)}, got {_first_word(argv)}")
    if argv[:2] == ["bench", "gpu"]:  # it shares the GPUs with its subprocesses: no preallocation
        for name, value in bench_gpu.PARENT_ENV.items():
            os.environ.setdefault(name, value)
    interrupt_outside_gc_callbacks()
    report_backend()
    try:
        COMMANDS[argv[0]](argv[1:])
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:  # a full, read-only or failing disk: reports are staged, so none is left half-written
        print(f"error: {e}; eval.main {argv[0]} stopped, and the reports it had not finished were not written (those "
              "there before are unchanged)", file=sys.stderr)
        sys.exit(2)
    except jax.errors.JaxRuntimeError as e:  # an out-of-memory traceback, hundreds of lines, said in one
        if (line := out_of_memory(e)) is None:
            raise
        print(f"error: {line} on {jax.default_backend()}: eval.main {argv[0]} stopped. Ask for less at once: "
              "fewer --problem_batch or rollouts per batch, a lower --max_new_tokens, shorter prompts or --seq_len",
              file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # reports are staged: one being rewritten is left as it was
        print(f"\ninterrupted: eval.main {argv[0]} stopped; reports it had not finished were not written",
              file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    exit_at_once_on_interrupt(main)  # a Ctrl-C's exit 130 without the teardown (it could segfault)
