"""`python -m eval.main <command> [--flags]`: generation, evaluation and benchmarks.

Commands:
  generate   load a HF-format checkpoint directory and sample a continuation of --prompt.
"""

from __future__ import annotations

import sys

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF-format checkpoint directory (config.json + safetensors).")
flags.DEFINE_string("prompt", "", "Prompt text (tokenized with the checkpoint's tokenizer).")
flags.DEFINE_string("prompt_ids", None, "Comma-separated token ids, for checkpoints without a tokenizer.")
flags.DEFINE_integer("max_new_tokens", 32, "Tokens to generate.")
flags.DEFINE_float("temperature", 0.6, "Sampling temperature (0 = greedy).")
flags.DEFINE_float("top_p", 0.95, "Nucleus sampling mass.")
flags.DEFINE_integer("top_k", 20, "Top-k filter (0 = off).")
flags.DEFINE_float("min_p", 0.0, "Min-p filter (0 = off).")
flags.DEFINE_integer("seed", 0, "Sampling seed.")

COMMANDS = ("generate",)


def cmd_generate() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvpop_jax import load_pretrained
    from kvpop_jax.generate import generate
    from kvpop_jax.modeling import Qwen3ForCausalLM
    from kvpop_jax.sampling import SamplingConfig

    if not FLAGS.checkpoint:
        raise app.UsageError("--checkpoint is required")
    config, params = load_pretrained(FLAGS.checkpoint)
    tokenizer = None
    if FLAGS.prompt_ids:
        ids = [int(t) for t in FLAGS.prompt_ids.split(",")]
    else:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(FLAGS.checkpoint)
        except (OSError, ValueError) as e:
            raise app.UsageError(
                f"no tokenizer in {FLAGS.checkpoint!r} ({e}); pass --prompt_ids instead of --prompt"
            ) from e
        ids = tokenizer(FLAGS.prompt)["input_ids"]
    if not ids:
        raise app.UsageError("the prompt is empty")
    eos = config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, tuple) else ((eos,) if eos is not None else ())
    sampling = SamplingConfig(FLAGS.temperature, FLAGS.top_p, FLAGS.top_k, FLAGS.min_p)
    tokens, lengths = generate(
        Qwen3ForCausalLM(config), params, jnp.asarray([ids]), max_new_tokens=FLAGS.max_new_tokens,
        sampling=sampling, eos_ids=eos_ids, rng=jax.random.key(FLAGS.seed),
    )
    out = np.asarray(tokens[0, : int(lengths[0])]).tolist()
    print("prompt ids:", ids)
    print("generated ids:", out)
    if tokenizer is not None:
        print("generated text:", tokenizer.decode(out))


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: python -m eval.main {{{'|'.join(COMMANDS)}}} [--flags]; got {argv[1:]}")
    if len(argv) > 2:
        raise app.UsageError(f"unexpected arguments {argv[2:]}")
    {"generate": cmd_generate}[argv[1]]()


if __name__ == "__main__":
    app.run(main, argv=sys.argv)
