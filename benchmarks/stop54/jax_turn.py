"""Time later turns of a `kvpop_jax.generate.Conversation` on the KVpop demo export (or another export).

    python benchmarks/stop54/jax_turn.py [--lengths 250,1000,2000] [--export checkpoints/demo-kvpop-mlstm]

A first turn of --prompt tokens, then for each length L two later turns of L random tokens with a 1-token reply:
the first pays the compiles of that length, the second is the run alone. Prints both in seconds. Run it on two
checkouts to compare their code.
"""

import argparse
import os
import time

import jax
import numpy as np

import kvpop_jax
from kvpop_jax import load_pretrained
from kvpop_jax.generate import Conversation
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_jax.sampling import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="250,1000,2000")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    args = ap.parse_args()
    config, params = load_pretrained(args.export)
    model = Qwen3ForCausalLM(config)
    rng = np.random.default_rng(0)
    greedy = SamplingConfig.greedy()
    print(f"kvpop_jax from {os.path.dirname(kvpop_jax.__file__)}; jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| later turn tokens | first turn of that length (s, with compiles) | second (s) |")
    print("|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        chat = Conversation(model, params)
        chat.send(rng.integers(0, config.vocab_size, size=args.prompt).tolist(), max_new_tokens=1, sampling=greedy)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            reply, _ = chat.send(rng.integers(0, config.vocab_size, size=length).tolist(), max_new_tokens=1,
                                 sampling=greedy)
            jax.block_until_ready(reply)
            times.append(time.perf_counter() - t0)
        print(f"| {length} | {times[0]:.2f} | {times[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
