"""Builds notebooks/explore.ipynb from the cells below (run: python notebooks/build_explore.py).

Keeping the notebook's source here keeps diffs readable; the .ipynb is committed too so
it opens in Colab/Jupyter as is, and tests/test_notebook.py executes it.
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    ("md", """# Exploring KVpop

KVpop keeps, per KV head, `s` sink tokens, a window of the `w` newest tokens and a learned
long-range top-`k`: a fixed budget `B = s + w + k` however long the sequence gets. This
notebook loads the bundled demo teacher (a tiny Qwen3 trained on the demo task, where
facts stated early are needed much later), runs it with the dense cache and with the
bounded KVpop cache, shows which tokens each layer keeps, and shows how to load a real
Qwen3 checkpoint.

Runs on a CPU in a minute or two. In Colab: `!pip install -e .` from a clone first."""),
    ("code", """import dataclasses, os, sys
sys.path.insert(0, os.path.abspath(".."))  # run from notebooks/ or the repo root
if os.path.basename(os.getcwd()) == "notebooks":
    os.chdir("..")
import jax, jax.numpy as jnp, numpy as np
from IPython.display import Image, Markdown, display

import kvpop_jax
REPO = os.path.dirname(os.path.dirname(os.path.abspath(kvpop_jax.__file__)))  # the clone `pip install -e .` used
if not os.path.isdir("checkpoints") and os.path.isdir(os.path.join(REPO, "checkpoints")):
    os.chdir(REPO)  # started elsewhere (Colab's /content): the shipped checkpoints are in the clone
from demo import task as demo_task
from kvpop_jax import KVpopConfig, load_pretrained
from kvpop_jax.cache import init_cache, init_dense_cache
from kvpop_jax.checkpoint import checkpoint_tokenizer
from kvpop_jax.generate import generate
from kvpop_jax.modeling import Qwen3ForCausalLM, retrofit_params
from kvpop_jax.sampling import SamplingConfig

# Parameters (tests shrink them through the environment).
TEACHER = os.environ.get("KVPOP_NB_TEACHER", "checkpoints/demo-teacher")
KVPOP = os.environ.get("KVPOP_NB_KVPOP", "checkpoints/demo-kvpop-mlstm")  # a trained KVpop export, if present
SEQ_LEN = int(os.environ.get("KVPOP_NB_SEQ_LEN", "1024"))  # prompt length of the demo problem
OUT = os.environ.get("KVPOP_NB_OUT", "outputs/notebook")
os.makedirs(OUT, exist_ok=True)
print(jax.devices())"""),
    ("md", "## The teacher and a demo problem"),
    ("code", """if not os.path.isdir(TEACHER):
    # No trained demo teacher here (python -m train.pretrain --flagfile=configs/tiny_teacher.flags
    # makes one): fall back to random weights with the demo tokenizer, so every cell still runs.
    from kvpop_jax import Qwen3Config, save_pretrained
    from kvpop_jax.modeling import init_params
    from demo.tokenizer import save_tokenizer
    TEACHER = os.path.join(OUT, "random-teacher")
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      max_position_embeddings=8192, bos_token_id=1, eos_token_id=2)
    save_pretrained(cfg, init_params(cfg, jax.random.key(0)), TEACHER)
    save_tokenizer(TEACHER)
    print("no trained teacher found: using random weights (answers will be wrong)")
config, params = load_pretrained(TEACHER)
tokenizer = checkpoint_tokenizer(TEACHER)
print(config)
example = demo_task.generate_example(demo_task.example_seed(0, "test", 7), seq_len=SEQ_LEN)  # a held-out problem
prompt_ids = jnp.asarray([tokenizer(example["prompt"])["input_ids"]])
print(f"prompt: {prompt_ids.shape[1]} tokens; expected answer: {example['answer']}")
print(example["prompt"][:300], "...", example["prompt"][-120:])"""),
    ("md", "## Dense decoding (the full KV cache)"),
    ("code", """eos = (tokenizer.eos_token_id,)
greedy = SamplingConfig.greedy()
dense_model = Qwen3ForCausalLM(config)
tokens, lengths = generate(dense_model, params, prompt_ids, max_new_tokens=40, sampling=greedy, eos_ids=eos)
dense_text = tokenizer.decode(np.asarray(tokens[0, : int(lengths[0])]), skip_special_tokens=True)
print(dense_text)
print("extracted:", demo_task.extract_answer(dense_text), "| correct:", demo_task.score(dense_text, example["answer"]))"""),
    ("md", """## KVpop decoding (the bounded cache)

`checkpoints/demo-kvpop-mlstm` is the KVpop-mLSTM retrofit of this teacher that the main
job (`python -m train.main --flagfile=configs/tiny_cpu.flags`) trains, copied from
`runs/tiny_cpu/kvpop-mlstm/export`; its scorers are learned. It decodes at `budget` entries per
KV head, its mLSTM state included (CR 88% of `SEQ_LEN`, as the main job evaluates it: at 1024
tokens that is the export's own k; other budgets change k only). Without it, the teacher is
retrofitted with fresh, zero-initialized scorers: all scores are equal and the decay makes
the long-range slots keep the most recent eligible tokens — a StreamingLLM-like policy,
which is exactly what training improves on."""),
    ("code", """budget = max(8, KVpopConfig.budget_at(0.88, SEQ_LEN))  # 12% of the context: 88% compression
export_dir = None  # the KVpop export the PyTorch cell below decodes, if it decodes at this budget
if os.path.isdir(KVPOP):
    kv_config, kv_params = load_pretrained(KVPOP)
    trained = kv_config.kvpop
    # Its memory per KV head (s + w + k plus the mLSTM state) at `budget`: k changes, the trained s and w stay.
    least = trained.memory(kv_config.head_dim) - trained.topk + 1  # s + w + state + one long-range slot
    if budget < least:
        print(f"budget {budget} is under this export's s + w + scorer state + 1 = {least}: using {least}")
        budget = least
    kv_config = dataclasses.replace(kv_config, kvpop=trained.retarget(budget, kv_config.head_dim))
    if kv_config.kvpop == trained:
        export_dir = KVPOP
    print(f"trained KVpop checkpoint {KVPOP} at memory {budget} per KV head "
          f"(k {trained.topk} -> {kv_config.kvpop.topk}):", kv_config.kvpop)
else:
    window = min(64, budget // 2)
    kv = KVpopConfig(sinks=4, window=window, topk=budget - 4 - window, scorer="mlstm", mlstm_chunk=64)
    kv_config = dataclasses.replace(config, kvpop=kv)
    kv_params = retrofit_params(kv_config, params, jax.random.key(0))
    print("untrained retrofit:", kv)
kv_model = Qwen3ForCausalLM(kv_config)
tokens, lengths = generate(kv_model, kv_params, prompt_ids, max_new_tokens=40, sampling=greedy, eos_ids=eos)
kv_text = tokenizer.decode(np.asarray(tokens[0, : int(lengths[0])]), skip_special_tokens=True)
print(kv_text)
print("extracted:", demo_task.extract_answer(kv_text), "| correct:", demo_task.score(kv_text, example["answer"]))"""),
    ("md", """## The same export in PyTorch `transformers`

`kvpop_torch` (`pip install -e ".[torch]"`) serves a KVpop export with `transformers`'
`generate` and a bounded `KVpopCache` (same slots, same evictions), without JAX: greedy
decoding gives the tokens above."""),
    ("code", """try:
    import torch, kvpop_torch
except ImportError:
    print("PyTorch side skipped: pip install -e '.[torch]'")
else:
    torch.set_num_threads(1)  # a tiny model: one thread is fastest
    if export_dir is None:  # the retrofit above (untrained, or retargeted to `budget`), exported
        from kvpop_jax import save_pretrained
        export_dir = os.path.join(OUT, "kvpop-export")
        save_pretrained(kv_config, kv_params, export_dir)
    pt_model, make_cache = kvpop_torch.load(export_dir)
    pt_cache = make_cache()
    with torch.no_grad():
        out = pt_model.generate(torch.tensor(np.asarray(prompt_ids)), cache=pt_cache, max_new_tokens=40,
                                do_sample=False, eos_token_id=list(eos), pad_token_id=0)
    pt_text = tokenizer.decode(out[0, prompt_ids.shape[1]:].tolist(), skip_special_tokens=True)
    print(pt_text)
    print("same as JAX:", pt_text == kv_text, f"| cache: {pt_cache.nbytes:,} bytes, {len(pt_cache.layers)} layers x "
          f"{tuple(pt_cache.layers[0].keys.shape)} slots")"""),
    ("md", "## Cache memory: constant for KVpop, linear for dense"),
    ("code", """total = prompt_ids.shape[1] + 40
dense_bytes = init_dense_cache(config, 1, total).nbytes
kv_bytes = init_cache(kv_config, 1).nbytes
display(Markdown(f"| cache | bytes at {total} tokens | grows with length |\\n|---|---:|---|\\n"
                 f"| dense | {dense_bytes:,} | yes, linearly |\\n| KVpop (B = {kv_config.kvpop.budget}) | {kv_bytes:,} | no |"))"""),
    ("md", """## Which tokens does each layer keep?

Rows are layers, columns the newest evictable tokens, colour = how many KV heads keep the
token in their long-range slots at the last prompt position (the paper's Fig. 6)."""),
    ("code", """from eval.patterns import run_patterns

result = run_patterns((kv_config, kv_params), np.asarray(prompt_ids[0]), out_dir=OUT, last_n=min(112, SEQ_LEN // 4))
display(Image(filename=result.files["png"]))
display(Image(filename=result.files["usage_png"]))"""),
    ("md", """## Loading a real Qwen3 checkpoint

The same code loads any HF Qwen3 directory (safetensors only; pickles are refused) — e.g. a
local copy of `Qwen/Qwen3-4B`. Below, a tiny random Qwen3 is written with `transformers`
so the cell runs offline; point `QWEN3_DIR` at a real checkpoint to use it instead."""),
    ("code", """QWEN3_DIR = os.environ.get("QWEN3_DIR", "")
if not QWEN3_DIR:
    import transformers
    QWEN3_DIR = os.path.join(OUT, "tiny-qwen3")
    hf = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.Qwen3ForCausalLM(hf).save_pretrained(QWEN3_DIR)
qwen_config, qwen_params = load_pretrained(QWEN3_DIR, dtype=jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32)
qwen_kv = dataclasses.replace(qwen_config, kvpop=KVpopConfig(sinks=4, window=256, topk=2016, scorer="mlstm"))
qwen_kv_params = retrofit_params(qwen_kv, qwen_params, jax.random.key(0))
print(qwen_kv.kvpop, "budget", qwen_kv.kvpop.budget)
# Training retrofits it: python -m train.main --flagfile=configs/qwen3_4b_cr88.flags --init_checkpoint=QWEN3_DIR"""),
]


def build(path: str) -> None:
    nb = new_notebook()
    # Fixed cell ids (nbformat draws random ones): a rebuild of unchanged cells leaves the .ipynb byte-identical.
    nb.cells = [(new_markdown_cell if kind == "md" else new_code_cell)(src, id=f"cell-{i}")
                for i, (kind, src) in enumerate(CELLS)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


if __name__ == "__main__":
    build(os.path.join(os.path.dirname(os.path.abspath(__file__)), "explore.ipynb"))
