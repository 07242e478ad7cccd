"""Time first turns of new `kvpop_jax.generate.Conversation`s of several prompt lengths, as a notebook user
sends them, on the KVpop demo export (or another export).

    python benchmarks/stop55/first_turn.py [--lengths 900,950,1000,700,1000] [--export checkpoints/demo-kvpop-mlstm]

Each length in order on a fresh Conversation with a 16-token greedy reply: a length (or power of two) not seen
before pays its compiles. Prints the seconds per turn and in all, and whether each reply equals `generate`'s.
Run it on two checkouts to compare their code.
"""

import argparse
import os
import time

import jax
import numpy as np

import kvpop_jax
from kvpop_jax import load_pretrained
from kvpop_jax.generate import Conversation, generate
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_jax.sampling import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="900,950,1000,700,1000")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    args = ap.parse_args()
    config, params = load_pretrained(args.export)
    model = Qwen3ForCausalLM(config)
    rng = np.random.default_rng(0)
    greedy = SamplingConfig.greedy()
    print(f"kvpop_jax from {os.path.dirname(kvpop_jax.__file__)}; jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| first turn tokens | s (with any compiles) | reply equals generate's |")
    print("|---|---|---|")
    total = 0.0
    for length in map(int, args.lengths.split(",")):
        prompt = rng.integers(0, config.vocab_size, size=length).tolist()
        t0 = time.perf_counter()
        reply, _ = Conversation(model, params).send(prompt, max_new_tokens=16, sampling=greedy)
        jax.block_until_ready(reply)
        seconds = time.perf_counter() - t0
        total += seconds
        expected, _ = generate(model, params, [prompt], max_new_tokens=16, sampling=greedy)
        same = bool(np.array_equal(np.asarray(reply), np.asarray(expected[0])))
        print(f"| {length} | {seconds:.2f} | {same} |", flush=True)
    print(f"| all | {total:.2f} | |")


if __name__ == "__main__":
    main()
