"""The demo teacher's train step per curriculum phase (batch x length), with dense attention run
tiled (the default now) and with the whole-matrix reference, parking loss on (half the queries
parked) and off. A random 2-layer teacher of the demo's shape; mean of 3 steps after the compile.

    python benchmarks/stop30/teacher_steps.py
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import train.demo_teacher.loop as loop
from kvpop_jax import Qwen3Config, attention
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop29"))
from timing import bench  # noqa: E402

config = Qwen3Config(vocab_size=92, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, rope_theta=1e8, max_position_embeddings=4096)
model = Qwen3ForCausalLM(config)
params = init_params(config, jax.random.key(0))
opt = optax.adam(1e-3)
TILED_MIN = attention.DENSE_TILED_MIN_QUERIES
for b, s in [(32, 128), (16, 256), (8, 512), (8, 1024)]:
    rng = np.random.default_rng(0)
    batch = dict(input_ids=jnp.asarray(rng.integers(3, 92, (b, s))), targets=jnp.asarray(rng.integers(3, 92, (b, s))),
                 weights=jnp.ones((b, s)), completion=jnp.asarray(rng.random((b, s)) < 0.05),
                 park=jnp.asarray(rng.random((b, s)) < 0.5))
    for attn in ("tiled", "reference"):
        attention.DENSE_TILED_MIN_QUERIES = TILED_MIN if attn == "tiled" else 1 << 30
        for park_weight in (1.0, 0.0):
            step = loop.make_train_step(model, opt, park_weight=park_weight, park_window=32)
            p = jax.tree.map(jnp.copy, params)
            state = loop.TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p))
            seconds = bench(lambda st: step(jax.tree.map(jnp.copy, st), batch)[1], state)  # step donates its state
            print(f"{b} x {s}, {attn}, park loss {'on' if park_weight else 'off'}: {seconds:.3f} s/step", flush=True)
