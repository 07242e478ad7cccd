"""Training data: documents -> checkpoint-tokenizer ids -> packed rows of exactly S tokens.

    config = DataConfig(data="nvidia/Nemotron-Math-v2", split="high_part00", seq_len=16384,
                        batch_size=128, process_index=jax.process_index(),
                        process_count=jax.process_count())
    batches = PackedBatchIterator(config, checkpoint_dir)   # or a tokenizer object
    batch = next(batches)           # dict of numpy arrays, each [B / process_count, S]
    saved = batches.state()         # JSON-serializable; store it with the checkpoint
    batches.restore(saved)          # continue exactly where `saved` was taken

Sources and text fields: `kvpop_jax/documents.py` (hub names, local files, chat rendering).

Length filter: a document's length counts its EOS; documents outside [min_length, max_length]
are dropped before packing (max_length defaults to S: the paper trains on sequences <= S). A text
longer than 64 * (max_length + 64) characters is tokenized by that head first, and dropped when the head alone
is too long (`documents.tokenize`).

Packing (greedy, in the epoch's document order, rows filled one after another):
- split_documents=False (default): a document that does not fit the rest of the row starts the
  next row and the rest is padded; no document is ever cut, so every kept document is seen
  whole, in one row.
- split_documents=True: one continuous token stream chunked into rows of S; no padding, a
  document may continue in the next row.
The stream runs on across epochs: a row may end one epoch and start the next.

Per row, shapes [B, S]:
- input_ids int32; padding is tokenizer.pad_token_id (EOS when it has none).
- targets int32: input_ids shifted left by one (the last column is padding).
- segment_ids int32: 1, 2, ... for the document pieces of the row in order, 0 for padding.
- positions int32: 0..S-1 when reset_attention=False (the paper: attention runs over the whole
  packed row and segment_ids are informative only); else restart at 0 at every segment start.
- loss_mask float32: 1 where the next token is in the same segment, so 0 on padding, on the last
  token of every document piece (no EOS -> next document prediction) and on the row's last token.

Epochs: document order is a permutation drawn from (seed, epoch) (identity if shuffle=False;
for streams, HF's buffered shuffle seeded the same way). Hosts: every host builds the same
global batch of `batch_size` rows and keeps its contiguous slice of batch_size / process_count
rows, so batches do not depend on the host count (a run may resume on another one).

State: {"version", "epoch", "index", "offset", "batches", "config"}: the next unpacked token is
`offset` tokens into the document at `index` of `epoch`'s order. In memory, `index` counts kept
documents; in a stream it counts raw examples, and restoring skips that many (reading, not
tokenizing, them). "config" holds the settings that change the stream; restoring checks them.

Memory: local files (streaming=False) are read with `datasets` (memory-mapped Arrow) and all kept
documents are tokenized up front (progress bar): ~4 bytes per token held, fine for the demo and
for up to ~10^8 tokens. Streams (hub default, or streaming=True) hold only the shuffle buffer
(`shuffle_buffer` examples) and one chunk of tokenized documents.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from typing import Any, Iterator

import numpy as np
from tqdm.auto import tqdm

from kvpop_jax.checkpoint import load_tokenizer
from kvpop_jax.documents import (DocumentSpec, TextSpec, checked_rows, chunks, columns_and_first, no_text_error,
                                 open_dataset, render, text_spec, tokenize)

_TOKENIZE_CHUNK = 256
_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where documents come from and how they become [batch_size / process_count, seq_len] rows.

    batch_size is the global number of rows per step (all hosts together). max_length=None
    means seq_len. streaming=None streams hub datasets and reads local files up front.
    """

    data: str
    seq_len: int
    batch_size: int
    text_field: str = "auto"
    split: str = "train"
    subset: str | None = None
    seed: int = 0
    shuffle: bool = True
    reset_attention: bool = False
    split_documents: bool = False
    min_length: int = 2
    max_length: int | None = None
    process_index: int = 0
    process_count: int = 1
    streaming: bool | None = None
    shuffle_buffer: int = 10_000
    cache_dir: str | None = None

    def __post_init__(self):
        DocumentSpec(self.data, self.text_field, self.split, self.subset)  # validates the source fields
        if self.seq_len < 2 or self.batch_size < 1:
            raise ValueError(f"need seq_len >= 2 and batch_size >= 1, got {self.seq_len}, {self.batch_size}")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"need 0 <= process_index < process_count, got {self.process_index}, {self.process_count}")
        if self.batch_size % self.process_count:
            raise ValueError(f"batch_size={self.batch_size} is not divisible by process_count={self.process_count}")
        if self.min_length < 1 or self.min_length > self.length_limit:
            raise ValueError(f"need 1 <= min_length <= max_length, got {self.min_length}, {self.length_limit}")
        if not self.split_documents and self.length_limit > self.seq_len:
            raise ValueError(f"max_length={self.max_length} > seq_len={self.seq_len} needs split_documents=True: "
                             "a longer document cannot be packed whole")
        if self.seed < 0 or self.shuffle_buffer < 1:
            raise ValueError(f"need seed >= 0 and shuffle_buffer >= 1, got {self.seed}, {self.shuffle_buffer}")

    @property
    def length_limit(self) -> int:
        return self.seq_len if self.max_length is None else self.max_length

    @property
    def host_batch_size(self) -> int:
        return self.batch_size // self.process_count

    @property
    def documents(self) -> DocumentSpec:
        return DocumentSpec(self.data, self.text_field, self.split, self.subset, self.streaming, self.cache_dir)


# --------------------------------------------------------------------------------- documents

def _epoch_seed(seed: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


class _InMemoryDocuments:
    """Every kept document tokenized up front; the epoch order indexes the kept ones."""

    def __init__(self, config: DataConfig, tokenizer, ds, spec: TextSpec):
        self.config = config
        self.tokens: list[np.ndarray] = []
        self.stats = Counter()
        bar = tqdm(total=len(ds), desc="tokenizing", unit="doc", disable=config.process_index != 0)
        for chunk in chunks(checked_rows(config.documents, ds), _TOKENIZE_CHUNK):  # a bad row names its file
            texts = [t for t in (render(e, spec, tokenizer) for e in chunk) if t is not None]
            if len(texts) < len(chunk):
                self.stats["no_text"] += len(chunk) - len(texts)
            for ids in tokenize(texts, tokenizer, spec.chat, limit=config.length_limit):
                verdict = _length_verdict(config, len(ids))
                self.stats[verdict] += 1
                if verdict == "kept":
                    self.tokens.append(ids)
            bar.update(len(chunk))
        bar.close()
        if not self.tokens and self.stats["no_text"] == len(ds):
            raise no_text_error(config.documents, spec, len(ds))
        if not self.tokens:
            raise ValueError(f"data={config.data}: no document has between {config.min_length} and "
                             f"{config.length_limit} tokens ({dict(self.stats)})")

    def order(self, epoch: int) -> np.ndarray:
        n = len(self.tokens)
        return np.random.default_rng(_epoch_seed(self.config.seed, epoch)).permutation(n) if self.config.shuffle else np.arange(n)

    def epoch_documents(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        order = self.order(epoch)
        for i in range(start, len(order)):
            yield i, self.tokens[order[i]]


class _StreamedDocuments:
    """Documents tokenized a chunk at a time as the (buffer-shuffled) stream is read; the index
    counts raw examples, so a resumed stream skips exactly the examples already read."""

    def __init__(self, config: DataConfig, tokenizer, ds, spec: TextSpec):
        self.config, self.tokenizer, self.ds, self.spec = config, tokenizer, ds, spec
        self.stats = Counter()

    def epoch_documents(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
        ds = self.ds
        if self.config.shuffle:
            ds = ds.shuffle(seed=_epoch_seed(self.config.seed, epoch), buffer_size=self.config.shuffle_buffer)
        if start:
            ds = ds.skip(start)
        rows = with_text = 0
        for chunk in chunks(enumerate(checked_rows(self.config.documents, ds), start), _TOKENIZE_CHUNK):
            texts = [(i, render(e, self.spec, self.tokenizer)) for i, e in chunk]
            texts = [(i, t) for i, t in texts if t is not None]
            rows, with_text = rows + len(chunk), with_text + len(texts)
            if len(texts) < len(chunk):
                self.stats["no_text"] += len(chunk) - len(texts)
            encoded = tokenize([t for _, t in texts], self.tokenizer, self.spec.chat, limit=self.config.length_limit)
            for (i, _), ids in zip(texts, encoded):
                verdict = _length_verdict(self.config, len(ids))
                self.stats[verdict] += 1
                if verdict == "kept":
                    yield i, ids
        if start == 0 and rows and not with_text:
            raise no_text_error(self.config.documents, self.spec, rows)


def _length_verdict(config: DataConfig, n_tokens: int) -> str:
    if n_tokens < config.min_length:
        return "too_short"
    return "too_long" if n_tokens > config.length_limit else "kept"


class _Cursor:
    """Head of the endless document stream (epoch after epoch): document `index` of `epoch`'s
    order, whose first `offset` tokens are already packed."""

    def __init__(self, documents, epoch: int, index: int, offset: int):
        self._documents, self.epoch = documents, epoch
        self._stream = documents.epoch_documents(epoch, index)
        self._next_document(offset)

    def _next_document(self, offset: int = 0):
        for fresh_epoch in (False, True):
            item = next(self._stream, None)
            if item is not None:
                self.index, self._tokens = item
                self.offset = offset
                if offset >= len(self._tokens):
                    raise ValueError(f"state offset {offset} is past document {self.index} of epoch {self.epoch}")
                return
            if fresh_epoch:
                break
            self.epoch += 1
            self._stream = self._documents.epoch_documents(self.epoch, 0)
        raise ValueError(f"epoch {self.epoch} has no document within the length limits")

    def remaining(self) -> np.ndarray:
        return self._tokens[self.offset:]

    def consume(self, n: int):
        self.offset += n
        if self.offset == len(self._tokens):
            self._next_document()


# --------------------------------------------------------------------------------- packing

def pack_row(cursor: _Cursor, seq_len: int, split_documents: bool, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedily fills one row from the cursor: (input_ids int32 [S], segment_ids int32 [S])."""
    ids_S = np.full(seq_len, pad_id, np.int32)
    segment_S = np.zeros(seq_len, np.int32)
    fill = segment = 0
    while fill < seq_len:
        piece = cursor.remaining()
        if len(piece) > seq_len - fill:
            if not split_documents:
                assert fill > 0, "the length filter admits no document longer than seq_len"
                break
            piece = piece[:seq_len - fill]
        segment += 1
        ids_S[fill:fill + len(piece)] = piece
        segment_S[fill:fill + len(piece)] = segment
        fill += len(piece)
        cursor.consume(len(piece))
    return ids_S, segment_S


def row_features(ids_BxS: np.ndarray, segment_BxS: np.ndarray, reset_attention: bool, pad_id: int) -> dict[str, np.ndarray]:
    """targets, positions and loss_mask of packed rows (see the module docstring), all [B, S]."""
    B, S = ids_BxS.shape
    arange_S = np.arange(S, dtype=np.int32)
    if reset_attention:
        starts_BxS = np.ones((B, S), bool)
        starts_BxS[:, 1:] = segment_BxS[:, 1:] != segment_BxS[:, :-1]
        positions_BxS = arange_S - np.maximum.accumulate(np.where(starts_BxS, arange_S, 0), axis=1)
    else:
        positions_BxS = np.broadcast_to(arange_S, (B, S))
    loss_mask_BxS = np.zeros((B, S), np.float32)
    loss_mask_BxS[:, :-1] = (segment_BxS[:, :-1] == segment_BxS[:, 1:]) & (segment_BxS[:, :-1] > 0)
    targets_BxS = np.full((B, S), pad_id, np.int32)
    targets_BxS[:, :-1] = ids_BxS[:, 1:]
    return dict(input_ids=ids_BxS, targets=targets_BxS, positions=positions_BxS.astype(np.int32),
                segment_ids=segment_BxS, loss_mask=loss_mask_BxS)


class DamagedDataState(ValueError):
    """A data state no run saved (a hand edit, damage): `PackedBatchIterator.restore` names the field."""

    def __init__(self, what: str):
        super().__init__(f"the data state is not one a run saved: {what}")


class PackedBatchIterator:
    """Endless iterator of this host's packed batches: dicts of numpy arrays, each
    [batch_size / process_count, seq_len] (keys: input_ids, targets, positions, segment_ids,
    loss_mask). `tokenizer` is a tokenizer or a checkpoint directory holding one."""

    def __init__(self, config: DataConfig, tokenizer: Any):
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = load_tokenizer(tokenizer)
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; documents need one as separator")
        self.config, self.tokenizer = config, tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ds = open_dataset(config.documents)
        spec = text_spec(config.documents, *columns_and_first(config.documents, ds), rows=ds)
        import datasets  # heavy, and only needed once a source is opened

        streamed = isinstance(ds, datasets.IterableDataset)
        self._documents = (_StreamedDocuments if streamed else _InMemoryDocuments)(config, tokenizer, ds, spec)
        self.num_documents = None if streamed else len(self._documents.tokens)
        self.num_tokens = None if streamed else sum(len(t) for t in self._documents.tokens)  # of the kept ones
        if not streamed:
            logging.info("data: %d documents kept, %s", self.num_documents, dict(self._documents.stats))
        self._position = (0, 0, 0)  # epoch, index, offset: where the cursor (made lazily) starts
        self._cursor: _Cursor | None = None
        self._batches = 0

    @property
    def stats(self) -> dict[str, int]:
        """Documents kept / too_long / too_short so far (all of them up front when in memory)."""
        return dict(self._documents.stats)

    @property
    def epoch(self) -> int:
        return self._cursor.epoch if self._cursor is not None else self._position[0]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        c = self.config
        if self._cursor is None:
            self._cursor = _Cursor(self._documents, *self._position)
        rows = [pack_row(self._cursor, c.seq_len, c.split_documents, self.pad_id) for _ in range(c.batch_size)]
        mine = rows[c.process_index * c.host_batch_size:(c.process_index + 1) * c.host_batch_size]
        self._batches += 1
        return row_features(np.stack([r[0] for r in mine]), np.stack([r[1] for r in mine]),
                            c.reset_attention, self.pad_id)

    def _fingerprint(self) -> dict[str, int]:
        c = self.config
        return dict(seq_len=c.seq_len, batch_size=c.batch_size, seed=c.seed, shuffle=int(c.shuffle),
                    split_documents=int(c.split_documents), min_length=c.min_length,
                    max_length=c.length_limit, streamed=int(self.num_documents is None),
                    num_documents=-1 if self.num_documents is None else self.num_documents)

    def state(self) -> dict[str, Any]:
        """Where the next batch starts: plain ints, JSON-serializable."""
        cur = self._cursor
        epoch, index, offset = (cur.epoch, cur.index, cur.offset) if cur is not None else self._position
        return dict(version=_STATE_VERSION, epoch=int(epoch), index=int(index), offset=int(offset),
                    batches=self._batches, config=self._fingerprint())

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()` of an iterator with the same data settings. A state it did not write (a hand
        edit) is a ValueError naming the field: a negative offset or a far index would be taken silently. (A
        streamed source's index counts raw examples, not known ahead: one past its end starts the next epoch.)"""
        if not isinstance(state, dict):
            raise DamagedDataState(f"{repr(state)[:40]} is not an object")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data state version {repr(state.get('version'))[:40]} is not {_STATE_VERSION}")
        position = {k: state.get(k) for k in ("epoch", "index", "offset", "batches")}
        problems = [f"{k} {repr(v)[:40]} is not an int >= 0" for k, v in position.items()
                    if type(v) is not int or v < 0]
        if not isinstance(state.get("config"), dict):
            problems.append(f"config {repr(state.get('config'))[:40]} is not an object")
        if problems:
            raise DamagedDataState(f"its {problems[0]}")
        saved, now = state["config"], self._fingerprint()
        changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if changed:
            raise ValueError(f"the data state was saved with other settings (saved, now): {changed}")
        if self.num_documents is not None:
            if position["index"] >= self.num_documents:
                raise DamagedDataState(f"its index {position['index']} is past its {self.num_documents} documents")
            document = self._documents.tokens[self._documents.order(position["epoch"])[position["index"]]]
            if position["offset"] >= len(document):
                raise DamagedDataState(f"its offset {position['offset']} is past its document ({len(document)} "
                                       "tokens)")
        self._position = (position["epoch"], position["index"], position["offset"])
        self._cursor = None
        self._batches = position["batches"]
