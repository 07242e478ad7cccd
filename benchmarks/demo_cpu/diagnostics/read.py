import os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_probe import layer_probs
from kvpop_jax import load_pretrained
from eval.demo_task import generate_dataset
from eval.plots import checkpoint_tokenizer
path = 'checkpoints/demo-teacher'
c, p = load_pretrained(path); tok = checkpoint_tokenizer(path)
for ex in generate_dataset(4, 0, 'test', seq_len=1024):
    ids = tok(ex['text'])['input_ids']; n = ex['meta']['n_prompt_tokens']
    facts = [f for f in ex['meta']['facts'] if f['queried']]
    toks = [tok.decode([t]) for t in ids]
    print('completion:', repr(''.join(toks[n:])), 'facts at', [(f['value_pos'], toks[f['value_pos'] - 1] + toks[f['value_pos']]) for f in facts])
    probs = [np.asarray(layer_probs(c, p, jnp.asarray([ids]), L))[0] for L in range(2)]
    for f in facts:
        name = toks[f['value_pos'] - 1]
        qs = [i for i in range(n, len(ids) - 1) if toks[i] == name]  # the completion position that emits the digit next
        for qpos in qs[:1]:
            for L in range(2):
                row = probs[L][:, qpos]
                print(f'  fact {name}{toks[f["value_pos"]]} query {qpos} L{L}: mass on fact per head', np.round(row[:, f['value_pos']], 2).tolist(),
                      'top of head 0:', [(int(j), toks[j - 1] + toks[j], round(float(row[0, j]), 2)) for j in np.argsort(-row[0])[:3]])
