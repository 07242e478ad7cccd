"""Time `kvpop_jax.generate.generate` on prompts whose length is not a power of two (stop 56).

    python benchmarks/stop56/jax_generate.py [--lengths 900,950,1000,700,1000] [--batch 50]

On the KVpop demo export and the dense demo teacher, each length in order, as a notebook user sends them: a batch
of `--batch` random prompts with a 16-token greedy reply; a length (or, with stop 56's blocks, a power of two) not
seen before pays its compiles. Then the steady state at the last length: the call again, next to the one-program
path generate keeps for powers of two (`_generate`: one prefill of the whole prompt), both already compiled, and
whether their tokens agree. Prints seconds. Run it on two checkouts to compare their code.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvpop_jax import load_pretrained
from kvpop_jax.generate import _generate, generate
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
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    for name, path, kind in (("KVpop-mLSTM export", "checkpoints/demo-kvpop-mlstm", "kvpop"),
                             ("dense teacher", "checkpoints/demo-teacher", "dense")):
        config, params = load_pretrained(path)
        model = Qwen3ForCausalLM(config)
        print(f"\n{name} ({path}), batch {args.batch}, {args.new} new tokens")
        print("| prompt tokens | s (with any compiles) |\n|---|---|")
        total = 0.0
        for length in lengths:
            prompt = rng.integers(0, config.vocab_size, size=(args.batch, length))
            _, seconds = timed(lambda: generate(model, params, prompt, max_new_tokens=args.new, sampling=GREEDY))
            total += seconds
            print(f"| {length} | {seconds:.2f} |", flush=True)
        print(f"| in all | {total:.2f} |")
        eos, key = jnp.asarray([-1], jnp.int32), jax.random.key(0)
        one = lambda: _generate(model, params, jnp.asarray(prompt), key, eos, max_new_tokens=args.new,  # noqa: E731
                                sampling=GREEDY, cache=kind)
        timed(one)  # its compile
        got, blocks_s = timed(lambda: generate(model, params, prompt, max_new_tokens=args.new, sampling=GREEDY))
        want, one_s = timed(one)
        agree = float(np.mean(np.asarray(got[0]) == np.asarray(want[0])))
        print(f"steady state at {lengths[-1]} tokens: generate {blocks_s:.2f} s, one program {one_s:.2f} s; "
              f"tokens agreeing {agree:.3f}")


if __name__ == "__main__":
    main()
