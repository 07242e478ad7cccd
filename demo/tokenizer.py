"""The demo tasks' tokenizer: one token per atom of `demo.atoms.ATOMS`, in HF format.

A WordLevel model over SPECIAL_TOKENS + ATOMS (92 entries), a Split pre-tokenizer on
`demo.atoms.TOKEN_PATTERN` (longest atom first; any other character becomes <unk>), and a Fuse
decoder that concatenates tokens, so whitespace is ordinary tokens (" " and "\\n") and
`decode(encode(text), skip_special_tokens=True) == text` for every text made of atoms, with no
whitespace normalization at all. Encoding prepends <bos> (the attention sink, like a template
would); <eos> is not added: append `tokenizer.eos_token_id` after a completion.

    tok = build_tokenizer(); save_tokenizer("ckpt/"); AutoTokenizer.from_pretrained("ckpt/")
"""

from __future__ import annotations

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from demo.atoms import BOS, EOS, PAD, TOKEN_PATTERN, UNK, VOCAB


def build_tokenizer(model_max_length: int = 8192) -> PreTrainedTokenizerFast:
    """The demo tokenizer: ids fixed by VOCAB (<pad>=0, <bos>=1, <eos>=2, <unk>=3)."""
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(TOKEN_PATTERN), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, VOCAB[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(directory, model_max_length: int = 8192) -> PreTrainedTokenizerFast:
    """Writes tokenizer.json + tokenizer_config.json to `directory` (loadable offline by
    `AutoTokenizer.from_pretrained(directory)`) and returns the tokenizer."""
    tokenizer = build_tokenizer(model_max_length)
    tokenizer.save_pretrained(str(directory))
    # transformers 5 writes its own class name ("TokenizersBackend"), unknown to 4.x; the
    # generic fast class loads the same tokenizer.json under both.
    config_path = os.path.join(str(directory), "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    return tokenizer
