"""Time turns of a `kvpop_jax.generate.Conversation` on the KVpop demo export (or another export).

    python benchmarks/stop54/jax_turn.py [--lengths 250,1000,2000] [--export checkpoints/demo-kvpop-mlstm]
    python benchmarks/stop54/jax_turn.py --first_turns 900,950,1000,700,1000      # stop 55

Later turns (stop 54): a first turn of --prompt tokens, then for each length L two later turns of L random tokens
with a 1-token reply: the first pays the compiles of that length, the second is the run alone. Prints both in
seconds.

First turns (--first_turns, stop 55): each length in order on a fresh Conversation with a 16-token greedy reply, as
a notebook user sends them: a length (or power of two) not seen before pays its compiles. Prints the seconds per
turn and in all, and whether each reply equals `generate`'s.

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


def timed_send(chat: Conversation, prompt: list[int], max_new_tokens: int):
    """(reply, seconds) of one greedy `send`, the reply computed."""
    t0 = time.perf_counter()
    reply, _ = chat.send(prompt, max_new_tokens=max_new_tokens, sampling=SamplingConfig.greedy())
    jax.block_until_ready(reply)
    return reply, time.perf_counter() - t0


def later_turns(model, params, rng, lengths: list[int], prompt: int) -> None:
    print("| later turn tokens | first turn of that length (s, with compiles) | second (s) |")
    print("|---|---|---|")
    vocab = model.config.vocab_size
    for length in lengths:
        chat = Conversation(model, params)
        timed_send(chat, rng.integers(0, vocab, size=prompt).tolist(), 1)
        times = [timed_send(chat, rng.integers(0, vocab, size=length).tolist(), 1)[1] for _ in range(2)]
        print(f"| {length} | {times[0]:.2f} | {times[1]:.2f} |", flush=True)


def first_turns(model, params, rng, lengths: list[int]) -> None:
    print("| first turn tokens | s (with any compiles) | reply equals generate's |")
    print("|---|---|---|")
    total = 0.0
    for length in lengths:
        prompt = rng.integers(0, model.config.vocab_size, size=length).tolist()
        reply, seconds = timed_send(Conversation(model, params), prompt, 16)
        total += seconds
        expected, _ = generate(model, params, [prompt], max_new_tokens=16, sampling=SamplingConfig.greedy())
        same = bool(np.array_equal(np.asarray(reply), np.asarray(expected[0])))
        print(f"| {length} | {seconds:.2f} | {same} |", flush=True)
    print(f"| all | {total:.2f} | |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="250,1000,2000")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--first_turns", default="", help="time first turns of these lengths instead (stop 55)")
    ap.add_argument("--export", default="checkpoints/demo-kvpop-mlstm")
    args = ap.parse_args()
    config, params = load_pretrained(args.export)
    model = Qwen3ForCausalLM(config)
    rng = np.random.default_rng(0)
    print(f"kvpop_jax from {os.path.dirname(kvpop_jax.__file__)}; jax {jax.__version__}, {jax.devices()[0].platform}")
    if args.first_turns:
        first_turns(model, params, rng, [int(n) for n in args.first_turns.split(",")])
    else:
        later_turns(model, params, rng, [int(n) for n in args.lengths.split(",")], args.prompt)


if __name__ == "__main__":
    main()
