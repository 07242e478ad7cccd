"""Where a training step of the main job's kvpop-mlstm goes: the recipe's loss (forward, and its
gradient) with one retention-loss option at a time switched off, on a random 4 x 1024 batch with a
precomputed teacher (as the job trains). Median of 5 calls after the compile.

    python benchmarks/stop30/train_step_parts.py
"""
import dataclasses, os, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from absl import flags
from train.flags import define_flags
from train.configure import config_from_flags
from train import setup, step as st
from kvpop_jax import modeling
from train.config import load_model_config
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "stop29"))
from timing import bench_median as bench  # noqa: E402

FLAGS = flags.FLAGS; define_flags(FLAGS)
FLAGS(["x", "--flagfile=configs/tiny_cpu.flags", "--teacher_logits_dir=" + tempfile.mkdtemp()] + sys.argv[1:])
cfg = config_from_flags(FLAGS)
mc = load_model_config(cfg)
sc0 = setup.step_config(cfg, mc)
params = modeling.init_params(sc0.model, jax.random.PRNGKey(0))
B, S, K = 4, 1024, 32
rng = np.random.default_rng(0)
mb = {"input_ids": jnp.asarray(rng.integers(3, 90, (B, S)), jnp.int32),
      "positions": jnp.broadcast_to(jnp.arange(S), (B, S)),
      "loss_mask": jnp.ones((B, S)), "teacher_values": jnp.asarray(rng.normal(size=(B, S, K)), jnp.float32),
      "teacher_indices": jnp.asarray(rng.integers(0, 90, (B, S, K)), jnp.int32)}
kv0 = sc0.model.kvpop
variants = {
    "recipe": {},
    "no listwise": dict(listwise_queries=0),
    "no rank pairs": dict(rank_pairs=0),
    "64 query samples": dict(num_query_samples=64),
    "sparse normalizer": dict(normalizer="sparse"),
}
for name, ch in variants.items():
    sc = dataclasses.replace(sc0, model=dataclasses.replace(sc0.model, kvpop=dataclasses.replace(kv0, **ch)))
    loss_fn = st.make_loss_fn(sc)
    g = jax.jit(jax.grad(lambda p, mb, r: loss_fn(p, None, mb, r, jnp.int32(0))[0]))
    f = jax.jit(lambda p, mb, r: loss_fn(p, None, mb, r, jnp.int32(0))[0])
    key = jax.random.key(1)
    print(f"{name}: loss fwd {bench(f, params, mb, key):.3f} s, grad {bench(g, params, mb, key):.3f} s", flush=True)
