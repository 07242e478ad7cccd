"""Time `kvpop_jax.generate.generate` on prompts whose length is not a power of two (stops 56 to 58).

    python benchmarks/stop56/jax_generate.py [--lengths 900,950,1000,700,1000] [--batch 50]
    python benchmarks/stop56/jax_generate.py --streamed [--budget 256]
    python benchmarks/stop56/jax_generate.py --one_shot [--budget 256]

Default (stop 56): the KVpop demo export and the dense demo teacher. `--streamed` (stop 57): `stream_prompt=True`
with StreamingLLM, TOVA and H2O on the dense teacher and with the KVpop export, at B `--budget`. `--one_shot`
(stop 58): the same baselines without it (a dense prefill, then compression: `eval.main accuracy`'s default; stop 58
pads such a prompt to a power of two). Each length in order,
as a notebook user or an evaluation of one's own prompts sends them: a batch of `--batch` random prompts with a
16-token greedy reply; a length (or, with stops 56-57's code, a power of two) not seen before pays its compiles. Then
the steady state at the last length: the call again, next to the per-length program generate keeps for powers of
two (`_generate`: one prefill of the whole prompt, or the first B tokens and a step per token after them, or
StreamingLLM's banded read), both already compiled, and whether their tokens agree. Prints seconds. Run it on two
checkouts to compare their code.
"""

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import load_pretrained
from kvpop_jax.baselines import BaselineConfig
from kvpop_jax.generate import _generate, _plan, generate
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_jax.sampling import SamplingConfig

GREEDY = SamplingConfig.greedy()


def timed(fn):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="900,950,1000,700,1000")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--streamed", action="store_true", help="stream_prompt=True with the baselines and KVpop")
    parser.add_argument("--one_shot", action="store_true", help="the baselines with one-shot compression")
    parser.add_argument("--budget", type=int, default=256, help="B of --streamed and --one_shot")
    args = parser.parse_args()
    if args.streamed and args.one_shot:
        parser.error("--streamed and --one_shot are two runs: give one")
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    teacher, export = load_pretrained("checkpoints/demo-teacher"), load_pretrained("checkpoints/demo-kvpop-mlstm")
    if args.streamed or args.one_shot:
        kv_config = dataclasses.replace(export[0], kvpop=export[0].kvpop.retarget(args.budget, export[0].head_dim))
        runs = [(f"StreamingLLM, B {args.budget}", *teacher, BaselineConfig("streaming", args.budget, sinks=4)),
                (f"TOVA, B {args.budget}", *teacher, BaselineConfig("tova", args.budget)),
                (f"H2O, B {args.budget}", *teacher, BaselineConfig("h2o", args.budget)),
                (f"KVpop-mLSTM export streamed, B {args.budget}", kv_config, export[1], "kvpop")]
        runs = runs if args.streamed else runs[:3]  # one-shot: the baselines (KVpop prefills alike either way)
    else:
        runs = [("KVpop-mLSTM export (checkpoints/demo-kvpop-mlstm)", *export, "auto"),
                ("dense teacher (checkpoints/demo-teacher)", *teacher, "auto")]
    for name, config, params, cache in runs:
        model = Qwen3ForCausalLM(config)
        call = lambda prompt: generate(model, params, prompt, max_new_tokens=args.new, sampling=GREEDY,  # noqa: E731
                                       cache=cache, stream_prompt=args.streamed)
        print(f"\n{name}, batch {args.batch}, {args.new} new tokens")
        print("| prompt tokens | s (with any compiles) |\n|---|---|")
        total = 0.0
        for length in lengths:
            prompt = rng.integers(0, config.vocab_size, size=(args.batch, length))
            _, seconds = timed(lambda: call(prompt))
            total += seconds
            print(f"| {length} | {seconds:.2f} |", flush=True)
        print(f"| in all | {total:.2f} |")
        kind, stream_from = _plan(config, cache, args.streamed)
        eos, key = jnp.asarray([-1], jnp.int32), jax.random.key(0)
        one = lambda: _generate(model, params, jnp.asarray(prompt), key, eos, max_new_tokens=args.new,  # noqa: E731
                                sampling=GREEDY, cache=kind, stream_from=stream_from)
        timed(one)  # its compile
        got, new_s = timed(lambda: call(prompt))
        want, one_s = timed(one)
        agree = float(np.mean(np.asarray(got[0]) == np.asarray(want[0])))
        print(f"steady state at {lengths[-1]} tokens: generate {new_s:.2f} s, per-length program {one_s:.2f} s; "
              f"tokens agreeing {agree:.3f}")


if __name__ == "__main__":
    main()
