"""`python -m eval.main <command> [--flags]`: generation, evaluation and benchmarks.

Commands (each prints its own `--help`):
  generate        sample a continuation of a prompt from a HF-format checkpoint directory
  bench kernels   time the Pallas kernels vs their XLA references and dense attention
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence


def cmd_generate(argv: Sequence[str]) -> None:
    """Samples a continuation of a prompt from a HF-format checkpoint (dense or KVpop)."""
    parser = argparse.ArgumentParser(prog="python -m eval.main generate", description=cmd_generate.__doc__)
    parser.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory")
    parser.add_argument("--prompt", default="", help="prompt text (uses the checkpoint's tokenizer)")
    parser.add_argument("--prompt_ids", default=None, help="comma-separated token ids (no tokenizer needed)")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=0.95)
    parser.add_argument("--top_k", type=int, default=20, help="0 = off")
    parser.add_argument("--min_p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvpop_jax import load_pretrained
    from kvpop_jax.generate import generate
    from kvpop_jax.modeling import Qwen3ForCausalLM
    from kvpop_jax.sampling import SamplingConfig

    config, params = load_pretrained(args.checkpoint)
    tokenizer = None
    if args.prompt_ids:
        ids = [int(t) for t in args.prompt_ids.split(",")]
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
        except (OSError, ValueError) as e:
            parser.error(f"no tokenizer in {args.checkpoint!r} ({e}); pass --prompt_ids instead of --prompt")
        ids = tokenizer(args.prompt)["input_ids"]
    if not ids:
        parser.error("the prompt is empty")
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple) else ((eos,) if eos is not None else ())
    sampling = SamplingConfig(args.temperature, args.top_p, args.top_k, args.min_p)
    tokens, lengths = generate(
        Qwen3ForCausalLM(config), params, jnp.asarray([ids]), max_new_tokens=args.max_new_tokens,
        sampling=sampling, eos_ids=eos_ids, rng=jax.random.key(args.seed),
    )
    out = np.asarray(tokens[0, : int(lengths[0])]).tolist()
    kind = "KVpop (bounded cache, B = %d)" % config.kvpop.budget if config.kvpop else "dense"
    print(f"model: {kind}")
    print("prompt ids:", ids)
    print("generated ids:", out)
    if tokenizer is not None:
        print("generated text:", tokenizer.decode(out))


def cmd_bench(argv: Sequence[str]) -> None:
    benches: dict[str, Callable[[Sequence[str]], None]] = {}
    from eval import bench_kernels

    benches["kernels"] = bench_kernels.main
    if not argv or argv[0] not in benches:
        raise SystemExit(f"usage: python -m eval.main bench {{{'|'.join(benches)}}} [--flags]; got {list(argv)}")
    benches[argv[0]](argv[1:])


COMMANDS: dict[str, Callable[[Sequence[str]], None]] = {"generate": cmd_generate, "bench": cmd_bench}


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: python -m eval.main {{{'|'.join(COMMANDS)}}} ... [--flags]; got {argv}\n\n{__doc__}")
    COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
