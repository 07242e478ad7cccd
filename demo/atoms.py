"""The demo tasks' alphabet: every atom is one token of the demo tokenizer (a leaf module).

The tokenizer's vocabulary is SPECIAL_TOKENS + ATOMS in this order (`VOCAB`); `atomize`
splits text exactly as the tokenizer's pre-tokenizer does (`TOKEN_PATTERN`).
"""

from __future__ import annotations

import re
import string

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
KEEP, ASK, BOXED, HASHES = "keep", "ask", "\\boxed{", "####"
DIGITS = tuple(string.digits)
NAMES = tuple(string.ascii_lowercase + string.ascii_uppercase)
# Every atom is one token; the tokenizer's vocabulary is SPECIAL_TOKENS + ATOMS in this order.
ATOMS = ("\n", " ") + DIGITS + NAMES + tuple("=+-*/%,;:?!.()[]{}<>") + (KEEP, ASK, BOXED, HASHES)
VOCAB = {token: i for i, token in enumerate(SPECIAL_TOKENS + ATOMS)}
# Longest atoms first, then any single character (unknown ones map to <unk>). Shared with the
# HF tokenizer's Split pre-tokenizer, so `atomize` and the tokenizer always agree.
TOKEN_PATTERN = "|".join(re.escape(a) for a in sorted(ATOMS, key=len, reverse=True)) + r"|[\s\S]"
_TOKEN_RE = re.compile(TOKEN_PATTERN)


def atomize(text: str) -> list[str]:
    """Splits text into tokens exactly as the demo tokenizer does (no <bos>)."""
    return _TOKEN_RE.findall(text)
