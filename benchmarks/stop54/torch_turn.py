"""Time one later chat turn of L tokens on a started kvpop_torch KVpopCache, and check it against L one-token calls.

    python benchmarks/stop54/torch_turn.py [--lengths 250,1000,2000] [--layers 8] [--export DIR]

Builds a random KVpop export (the delayed-readout mLSTM; Qwen3 shape set by the flags) unless --export names one,
prefills a 300-token prompt, then feeds a turn of L tokens in one call (what `model.generate(history, cache=...)`
does on a later turn) and, on a second cache, as L one-token calls. Prints the seconds of each, the largest logit
difference and whether every layer keeps the same positions. Run it on two checkouts to compare their code.
"""

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import kvpop_torch
from kvpop_jax import KVpopConfig, Qwen3Config, save_pretrained
from kvpop_jax.modeling import abstract_params


def random_export(path: str, layers: int, seed: int) -> None:
    base = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, rope_theta=1e6)
    config = dataclasses.replace(base, kvpop=KVpopConfig(sinks=4, window=64, topk=192, scorer="mlstm",
                                                         scorer_keys="unrotated"))
    rng = np.random.default_rng(seed)

    def draw(key_path, leaf):
        name = jax.tree_util.keystr(key_path)
        scale = 1.0 if "kvpop" in name else 1 / np.sqrt(base.hidden_size)
        x = 1.0 + 0.3 * rng.normal(size=leaf.shape) if "scale" in name else scale * rng.normal(size=leaf.shape)
        return jnp.asarray(x, leaf.dtype)

    save_pretrained(config, jax.tree_util.tree_map_with_path(draw, abstract_params(config)), path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="250,1000,2000")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--export", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as tmp:
        export = args.export or tmp
        if args.export is None:
            random_export(tmp, args.layers, args.seed)
        model, make_cache = kvpop_torch.load(export)
        vocab = model.config.vocab_size
        print(f"kvpop_torch from {os.path.dirname(kvpop_torch.__file__)}; {model.config.num_hidden_layers} layers, "
              f"budget {make_cache().layers[0].num_slots}, torch threads {torch.get_num_threads()}")
        print("| turn tokens | one call (s) | one-token calls (s) | max logit diff | same kept positions |")
        print("|---|---|---|---|---|")
        for length in map(int, args.lengths.split(",")):
            ids = torch.as_tensor(np.random.default_rng(length).integers(0, vocab, size=(1, args.prompt + length)))
            one, turn = make_cache(), make_cache()
            with torch.no_grad():
                model(ids[:, :args.prompt], cache=turn)
                model(ids[:, :args.prompt], cache=one)
                t0 = time.perf_counter()
                got = model(ids[:, args.prompt:], cache=turn).logits[:, -1]
                t_turn = time.perf_counter() - t0
                t0 = time.perf_counter()
                for t in range(args.prompt, args.prompt + length):
                    want = model(ids[:, t:t + 1], cache=one).logits[:, -1]
                t_one = time.perf_counter() - t0
            diff = float((got - want).abs().max())
            same = all(bool((a == b).all()) for a, b in zip(turn.positions(), one.positions()))
            print(f"| {length} | {t_turn:.2f} | {t_one:.2f} | {diff:.1e} | {same} |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
