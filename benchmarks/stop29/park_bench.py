import time
import jax, jax.numpy as jnp, numpy as np, optax
from kvpop_jax.modeling import Qwen3ForCausalLM, init_params
from kvpop_jax import Qwen3Config
import train.demo_teacher.loop as new
import train.demo_teacher.loop_old_tmp as old  # see README.md
config = Qwen3Config(vocab_size=92, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, rope_theta=1e8, max_position_embeddings=4096)
model = Qwen3ForCausalLM(config)
params = init_params(config, jax.random.key(0))
opt = optax.adam(1e-3)
for B, S in [(32, 128), (16, 256), (8, 512), (8, 1024)]:
    rng = np.random.default_rng(0)
    batch = dict(input_ids=jnp.asarray(rng.integers(3, 92, (B, S))), targets=jnp.asarray(rng.integers(3, 92, (B, S))),
                 weights=jnp.ones((B, S)), completion=jnp.asarray(rng.random((B, S)) < 0.05), park=jnp.asarray(rng.random((B, S)) < 0.5))
    for name, mod in (("old", old), ("new", new), ("none", new)):
        step = mod.make_train_step(model, opt, park_weight=0.0 if name == "none" else 1.0, park_window=32)
        p = jax.tree.map(jnp.copy, params); st = mod.TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p))
        st, m = step(st, batch); jax.block_until_ready(m)
        t = time.perf_counter()
        for _ in range(3): st, m = step(st, batch)
        jax.block_until_ready(m)
        print(B, S, name, f"{(time.perf_counter() - t) / 3:.3f} s/step", float(m.get("park", 0.0)), flush=True)
