"""Time `generate(stream_prompt=True)` on prompts whose length is not a power of two (stop 57).

    python benchmarks/stop57/streamed_lengths.py [--lengths 900,950,1000,700,1000] [--batch 50] [--budget 256]

StreamingLLM, TOVA and H2O on the dense demo teacher and the streamed KVpop-mLSTM export, as an evaluation of one's
own prompts of several lengths runs them: a batch of `--batch` random prompts per length, in order, with a 16-token
greedy reply; a length (with stop 57's padded stream, a power of two of the streamed tokens) not seen before pays its
compile. Then the steady state at the last length: the call again, next to the per-length program (`_generate` with
`stream_from`, or StreamingLLM's banded read: what generate ran before and keeps for powers of two), both compiled,
and whether their tokens agree. Prints seconds.
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
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--new", type=int, default=16)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    teacher, export = load_pretrained("checkpoints/demo-teacher"), load_pretrained("checkpoints/demo-kvpop-mlstm")
    kv_config = dataclasses.replace(export[0], kvpop=export[0].kvpop.retarget(args.budget, export[0].head_dim))
    runs = (("StreamingLLM", teacher[0], teacher[1], BaselineConfig("streaming", args.budget, sinks=4)),
            ("TOVA", teacher[0], teacher[1], BaselineConfig("tova", args.budget)),
            ("H2O", teacher[0], teacher[1], BaselineConfig("h2o", args.budget)),
            ("KVpop-mLSTM, streamed", kv_config, export[1], "kvpop"))
    for name, config, params, cache in runs:
        model = Qwen3ForCausalLM(config)
        print(f"\n{name}, B {args.budget}, batch {args.batch}, {args.new} new tokens")
        print("| prompt tokens | s (with any compiles) |\n|---|---|")
        total = 0.0
        for length in lengths:
            prompt = rng.integers(0, config.vocab_size, size=(args.batch, length))
            _, seconds = timed(lambda: generate(model, params, prompt, max_new_tokens=args.new, sampling=GREEDY,
                                                cache=cache, stream_prompt=True))
            total += seconds
            print(f"| {length} | {seconds:.2f} |", flush=True)
        print(f"| in all | {total:.2f} |")
        kind, stream_from = _plan(config, cache, True)
        eos, key = jnp.asarray([-1], jnp.int32), jax.random.key(0)
        one = lambda: _generate(model, params, jnp.asarray(prompt), key, eos, max_new_tokens=args.new,  # noqa: E731
                                sampling=GREEDY, cache=kind, stream_from=stream_from)
        timed(one)  # its compile
        got, new_s = timed(lambda: generate(model, params, prompt, max_new_tokens=args.new, sampling=GREEDY,
                                            cache=cache, stream_prompt=True))
        want, one_s = timed(one)
        agree = float(np.mean(np.asarray(got[0]) == np.asarray(want[0])))
        print(f"steady state at {lengths[-1]} tokens: generate {new_s:.2f} s, per-length program {one_s:.2f} s; "
              f"tokens agreeing {agree:.3f}")


if __name__ == "__main__":
    main()
