"""Teacher-target top-k inclusion of both queried facts (layer 1 / KV head 0 and best head), per target setting."""
import dataclasses, os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd())
from kvpop_jax import load_pretrained
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_jax.kvpop import kept_long_range
from eval.accuracy import retarget_kvpop
from eval.demo_task import generate_dataset
from eval.recall import policy_arrays
from eval.plots import checkpoint_tokenizer
exs = generate_dataset(24, 0, 'test', seq_len=1024)
path = 'checkpoints/demo-kvpop-mlstm'
config0, params = load_pretrained(path)
tok = checkpoint_tokenizer(path)
for agg in ('max', 'mean'):
    for norm in ('sparse', 'dense'):
        for cn in (True, False):
            kv = dataclasses.replace(retarget_kvpop(config0.kvpop, 123), aggregate=agg, normalizer=norm, count_normalize=cn)
            config = dataclasses.replace(config0, kvpop=kv)
            model = Qwen3ForCausalLM(config)
            thit = np.zeros((2, 2)); fact = np.zeros((2, 2)); nf = 0
            for ex in exs:
                ids = tok(ex['text'])['input_ids']; n = ex['meta']['n_prompt_tokens']; q = jnp.asarray([[n - 1]])
                arr = policy_arrays(model, params, jnp.asarray([ids]), q)
                need = [f['value_pos'] for f in ex['meta']['facts'] if f['queried']]
                for L in range(2):
                    tk = np.asarray(kept_long_range(arr['teacher_ranks'][L], arr['teacher_cutoffs'][L], q, sinks=4, window=32))[0, :, 0]
                    thit[L] += tk[:, need].all(-1); fact[L] += tk[:, need].mean(-1)
            print(agg, norm, 'count_norm' if cn else 'sum', 'all facts:', (thit / len(exs)).round(2).tolist(), 'per fact:', (fact / len(exs)).round(2).tolist(), flush=True)
