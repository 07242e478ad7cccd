import numpy as np, jax, jax.numpy as jnp
from kvpop_jax.modeling import Attention, RMSNorm, DecoderLayer
def layer_probs(c, p, ids, layer):
    pos = jnp.arange(ids.shape[1])[None]
    x = p['embed_tokens']['embedding'][ids]
    for i in range(layer):
        x = DecoderLayer(c).apply({'params': p[f'layers_{i}']}, x, pos)[0]
    h = RMSNorm(c.rms_norm_eps).apply({'params': p[f'layers_{layer}']['input_layernorm']}, x)
    q, k, v = Attention(c).apply({'params': p[f'layers_{layer}']['self_attn']}, h, pos, method=Attention.project_qkv)
    G = c.num_attention_heads // c.num_key_value_heads
    k = jnp.repeat(k, G, 2)
    lg = jnp.einsum('bshd,bthd->bhst', q, k) / np.sqrt(c.head_dim)
    S = ids.shape[1]; mask = np.tril(np.ones((S, S), bool))
    return jax.nn.softmax(jnp.where(mask, lg, -1e9), -1)
