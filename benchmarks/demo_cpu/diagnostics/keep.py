"""Are the queried facts' value tokens kept at the end of the prompt (CR 88, k = 87)? Per layer / KV head,
for the trained policy and for the teacher's future-attention target (its top-k at the same query)."""
import dataclasses, os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd())
from kvpop_jax import load_pretrained
from kvpop_jax.modeling import Qwen3ForCausalLM
from kvpop_jax.kvpop import kept_long_range
from eval.accuracy import retarget_kvpop
from eval.demo_task import generate_dataset
from eval.recall import policy_arrays
from eval.plots import checkpoint_tokenizer
N = 24
exs = generate_dataset(N, 0, 'test', seq_len=1024)
for name in sys.argv[1:]:
    path = f'runs/tiny_cpu/{name}/export'
    config, params = load_pretrained(path)
    config = dataclasses.replace(config, kvpop=retarget_kvpop(config.kvpop, 123))
    kv = config.kvpop
    tok = checkpoint_tokenizer(path)
    model = Qwen3ForCausalLM(config)
    hit = np.zeros((config.num_hidden_layers, config.num_key_value_heads)); thit = hit.copy(); tot = 0
    for ex in exs:
        ids = tok(ex['text'])['input_ids']
        n = ex['meta']['n_prompt_tokens']
        q = jnp.asarray([[n - 1]])
        arr = policy_arrays(model, params, jnp.asarray([ids]), q)
        need = [f['value_pos'] for f in ex['meta']['facts'] if f['queried']]
        for L in range(config.num_hidden_layers):
            keep = np.asarray(kept_long_range(arr['ranks'][L], arr['cutoffs'][L], q, sinks=kv.sinks, window=kv.window))[0, :, 0]
            tkeep = np.asarray(kept_long_range(arr['teacher_ranks'][L], arr['teacher_cutoffs'][L], q, sinks=kv.sinks, window=kv.window))[0, :, 0]
            hit[L] += keep[:, need].all(-1); thit[L] += tkeep[:, need].all(-1)
        tot += 1
    np.set_printoptions(precision=2)
    print(name, f'share of {tot} problems whose queried facts are all kept at the last prompt token, per [layer, kv head]:')
    print('  policy :', (hit / tot).tolist())
    print('  teacher target top-k:', (thit / tot).tolist())
