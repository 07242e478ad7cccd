"""Would a max-over-future-queries target single out the facts? Layer 1, KV head 0 (query heads 0, 1), dense
attention of the demo teacher; keys t in [4, q - w], future queries d >= t + w; top-87 at q = n - 1."""
import os, sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_probe import layer_probs
from kvpop_jax import load_pretrained
from eval.demo_task import generate_dataset
from eval.plots import checkpoint_tokenizer
path = 'checkpoints/demo-teacher'
c, p = load_pretrained(path); tok = checkpoint_tokenizer(path)
w, k = 32, 87
res = {'mean': [], 'max': []}
for ex in generate_dataset(24, 0, 'test', seq_len=1024):
    ids = tok(ex['text'])['input_ids']; n = ex['meta']['n_prompt_tokens']; S = len(ids)
    need = [f['value_pos'] for f in ex['meta']['facts'] if f['queried']]
    pr = np.asarray(layer_probs(c, p, jnp.asarray([ids]), 1))[0][:2]  # query heads 0, 1 -> KV head 0
    d = np.arange(S)[:, None]; t = np.arange(S)[None]
    fut = d >= t + w
    mean = np.where(fut, pr, 0).sum(1) / np.maximum(1, S - (np.arange(S) + w))  # [2, S]
    mx = np.where(fut, pr, 0).max(1)
    q = n - 1
    elig = np.arange(4, q - w + 1)
    for name, v in (('mean', mean.max(0)), ('max', mx.max(0))):
        top = set(elig[np.argsort(-v[elig])[:k]])
        res[name].append(all(x in top for x in need))
print({kk: float(np.mean(v)) for kk, v in res.items()}, 'share of 24 problems with both facts in the top-87 target')
