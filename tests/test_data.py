"""train/packing.py and kvpop_jax/documents.py: sources, text extraction, length filter, packing invariants, shuffle, resume,
host sharding. Local generated files and the demo tokenizer only (no network)."""

import json
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from demo.tokenizer import build_tokenizer, save_tokenizer
from kvpop_jax.documents import DocumentSpec, load_documents, resolve_source, tokenize
from train.packing import DataConfig, PackedBatchIterator
from train.step import real_lengths

CHARS = list("abcdefghij0123456789 ")
S, B = 32, 4


def random_texts(rng, n, lo=3, hi=40):
    return ["".join(rng.choice(CHARS, size=rng.integers(lo, hi + 1))) for _ in range(n)]


def write_jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def config(tmp_path, data, **kw):
    return DataConfig(data=str(data), seq_len=kw.pop("seq_len", S), batch_size=kw.pop("batch_size", B),
                      cache_dir=str(tmp_path / "hf_cache"), **kw)


def doc_ids(tokenizer, text):
    """What a plain-text document should become: <bos> + one token per char + <eos>."""
    return tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]


def segments(batches):
    """Every document piece of the batches, in row order, as token-id lists."""
    out = []
    for batch in batches:
        for ids, seg in zip(batch["input_ids"], batch["segment_ids"]):
            out += [ids[seg == k].tolist() for k in range(1, seg.max() + 1)]
    return out


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def assert_batches_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# --------------------------------------------------------------------------------- config

@pytest.mark.parametrize("kw, match", [
    (dict(batch_size=6, process_count=4), "divisible"),
    (dict(process_index=2, process_count=2), "process_index"),
    (dict(max_length=64), "split_documents"),
    (dict(min_length=40), "min_length"),
    (dict(seq_len=1), "seq_len"),
    (dict(text_field="prompt+"), "text_field"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**{"data": "x.jsonl", "seq_len": S, "batch_size": B, **kw})


# --------------------------------------------------------------------------------- sources

def _write(tmp_path, fmt, records):
    import datasets

    if fmt == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", records)
    if fmt == "json":  # one JSON array
        (tmp_path / "d.json").write_text(json.dumps(records))
        return str(tmp_path / "d.json")
    if fmt == "directory":  # nested, split over two files, read in path order
        write_jsonl(tmp_path / "dir" / "a" / "part0.jsonl", records[:3])
        write_jsonl(tmp_path / "dir" / "b" / "part1.jsonl", records[3:])
        return str(tmp_path / "dir")
    if fmt == "glob":
        write_jsonl(tmp_path / "g" / "part0.jsonl", records[:3])
        write_jsonl(tmp_path / "g" / "part1.jsonl", records[3:])
        (tmp_path / "g" / "notes.txt").write_text("not data")
        return str(tmp_path / "g" / "part*.jsonl")
    ds = datasets.Dataset.from_list(records)
    if fmt == "parquet":
        ds.to_parquet(str(tmp_path / "d.parquet"))
        return str(tmp_path / "d.parquet")
    ds.save_to_disk(str(tmp_path / "saved"))
    if fmt == "saved":
        return str(tmp_path / "saved")
    (arrow,) = [f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")]
    return str(tmp_path / "saved" / arrow)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "directory", "glob", "saved", "arrow"])
def test_local_sources(tmp_path, rng, fmt):
    texts = random_texts(rng, 7, hi=20)
    data = _write(tmp_path, fmt, [{"id": i, "text": t} for i, t in enumerate(texts)])
    assert list(load_documents(config(tmp_path, data).documents)) == texts
    batches = PackedBatchIterator(config(tmp_path, data, shuffle=False), build_tokenizer())
    assert segments(take(batches, 1))[0] == doc_ids(batches.tokenizer, texts[0])


def test_missing_paths_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere/train.jsonl"):
        resolve_source(str(tmp_path / "nowhere" / "train.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"no file matches"):
        resolve_source(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        resolve_source(str(tmp_path / "empty"))
    assert resolve_source("nvidia/Nemotron-Math-v2").kind == "hub"


def test_unreadable_file_is_named(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ab"}\n{"text": \n')
    with pytest.raises(ValueError, match="broken.jsonl"):
        list(load_documents(config(tmp_path, path).documents))


@pytest.mark.parametrize("streaming", [False, True])
def test_malformed_line_is_named_by_file_and_line_number(tmp_path, streaming):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "ab"}\n\n{"text": "cd"}\n{"text": "ef"\n{"text": "gh"}\n')
    with pytest.raises(ValueError, match=r"broken.jsonl line 4 is not valid JSON"):
        PackedBatchIterator(config(tmp_path, path, streaming=streaming), build_tokenizer())


def test_json_nested_too_deep_is_named_by_file_and_line(tmp_path):
    """A line of 100,000 nested brackets failed the readers, and then the search for the bad line with a
    RecursionError traceback naming no file."""
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + '}\n{"text": "ab"}\n')
    with pytest.raises(ValueError, match=r"deep.jsonl line 1 nests its JSON too deep"):
        PackedBatchIterator(config(tmp_path, path), build_tokenizer())


def test_a_reader_error_names_its_cause(tmp_path):
    """`datasets` wraps what went wrong in "DatasetGenerationError: An error occurred while generating the
    dataset"; the message stopped there, so a JSON line naming a column twice read as a mystery."""
    path = tmp_path / "twice.json"
    path.write_text('{"text": "a", "text": "b"}\n')
    with pytest.raises(ValueError, match=r"could not read .*twice.json: ArrowInvalid: .*Column\(/text\) was "
                                         r"specified twice"):
        list(load_documents(config(tmp_path, path).documents))


@pytest.mark.parametrize("streaming", [False, True])
def test_invalid_utf8_is_named_by_file(tmp_path, streaming):
    """Read up front, a line that is not UTF-8 was a bare UnicodeDecodeError naming no file (a stream named it)."""
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ab"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"could not read .*latin1.jsonl: UnicodeDecodeError"):
        next(PackedBatchIterator(config(tmp_path, path, streaming=streaming), build_tokenizer()))


def test_empty_jsonl_is_a_clear_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl is empty"):
        PackedBatchIterator(config(tmp_path, tmp_path / "empty.jsonl"), build_tokenizer())
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match=r"blank.jsonl is empty"):
        PackedBatchIterator(config(tmp_path, tmp_path / "blank.jsonl"), build_tokenizer())


@pytest.mark.parametrize("streaming", [False, True])
def test_no_usable_text_names_file_and_field(tmp_path, streaming):
    """Every `text` null or empty: no `<bos><eos>` rows to train on, an error naming the file and field."""
    data = write_jsonl(tmp_path / "nulls.jsonl", [{"text": None}, {"text": ""}, {"text": None}])
    with pytest.raises(ValueError, match=r"nulls.jsonl: the text field 'text' is null or empty in all 3 rows"):
        next(PackedBatchIterator(config(tmp_path, data, streaming=streaming), build_tokenizer()))
    # rows without text are skipped (and counted), never trained on
    data = write_jsonl(tmp_path / "some.jsonl", [{"text": None}, {"text": "abc"}, {"text": ""}, {"text": "de"}])
    batches = PackedBatchIterator(config(tmp_path, data, shuffle=False), build_tokenizer())
    tok = batches.tokenizer
    assert segments(take(batches, 1))[0][:7] == doc_ids(tok, "abc")
    assert batches.stats == {"kept": 2, "no_text": 2}


@pytest.mark.parametrize("field", ["auto", "prompt+missing"])
def test_missing_text_field_lists_columns(tmp_path, field):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "question_id": 3}])
    with pytest.raises(ValueError, match=r"available columns: \['prompt', 'question_id'\]"):
        PackedBatchIterator(config(tmp_path, data, text_field=field), build_tokenizer())


def test_tokenizer_from_checkpoint_dir(tmp_path, rng):
    save_tokenizer(tmp_path / "ckpt")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_texts(rng, 5)])
    batch = next(PackedBatchIterator(config(tmp_path, data), str(tmp_path / "ckpt")))
    assert batch["input_ids"].shape == (B, S)


# --------------------------------------------------------------------------------- text

CHAT = [{"role": "user", "content": "a+b"}, {"role": "assistant", "content": "c0"}]


def test_messages_use_chat_template(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "<bos>{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT, "text_len": 1}])
    assert list(load_documents(config(tmp_path, data).documents, tokenizer)) == ["<bos>u:a+b\na:c0\n"]
    batches = PackedBatchIterator(config(tmp_path, data), tokenizer)
    (doc,) = segments(take(batches, 1))[:1]
    # The template's <bos> is the only one: special tokens are not added to rendered chats.
    assert doc == tokenizer("u:a+b\na:c0\n")["input_ids"] + [tokenizer.eos_token_id]


def test_a_chat_template_that_fails_is_named_with_its_row(tmp_path):
    """A template's own raise_exception (Qwen-style "roles must alternate") and an attribute jinja's sandbox
    refuses were tracebacks from deep in the data pipeline, naming neither the field nor the row."""
    tokenizer = build_tokenizer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT, "text_len": 1}])
    for template, why in (("{% if messages[0]['role'] == 'user' %}{{ raise_exception('roles must alternate') }}"
                           "{% endif %}", "roles must alternate"),
                          ("{{ messages.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'")):
        tokenizer.chat_template = template
        with pytest.raises(ValueError, match=rf"chat template failed on the messages of field 'messages' \(.*{why}"
                                             r".*\): \"\[\{'role': 'user', 'content': 'a\+b'\}"):
            list(load_documents(config(tmp_path, data).documents, tokenizer))


def test_messages_without_template_and_prompt_fields(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    assert list(load_documents(config(tmp_path, chat).documents, build_tokenizer())) == ["user: a+b\nassistant: c0\n"]
    records = [{"prompt": "x1\n", "answer": "7", "completion": "y=7\n"}, {"prompt": "q", "answer": None, "completion": "z"}]
    qa = write_jsonl(tmp_path / "qa.jsonl", records)
    assert list(load_documents(config(tmp_path, qa).documents)) == ["x1\ny=7\n", "qz"]  # completion before answer
    assert list(load_documents(config(tmp_path, qa, text_field="prompt+answer").documents)) == ["x1\n7", "q"]


def test_messages_without_role_or_content_are_named(tmp_path):
    """Without a chat template a message lacking `role` or `content` was a KeyError traceback naming no field."""
    for message in ({"foo": "bar"}, {"role": "user"}, {"content": "hi"}):
        data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, {"messages": [message]}])
        with pytest.raises(ValueError, match="text field 'messages' holds a chat message that lacks 'role' or "
                                             "'content'"):
            list(load_documents(config(tmp_path, data).documents, build_tokenizer()))


def test_a_null_first_row_does_not_make_chat_text_and_non_text_values_are_named(tmp_path):
    """A chat column whose first row was null was read as plain text: every later row trained on the
    Python repr of its message list. Lists and objects in a text field were stringified the same way."""
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": None}, {"messages": CHAT}])
    assert list(load_documents(config(tmp_path, chat).documents, build_tokenizer())) == ["user: a+b\nassistant: c0\n"]
    for name, value in (("list", ["a", "b"]), ("dict", {"a": "b"})):
        bad = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": "fine"}, {"text": value}])
        with pytest.raises(ValueError, match=f"text field 'text' holds a {name} .*not text; set text_field"):
            list(load_documents(config(tmp_path, bad).documents))
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": CHAT}, {"messages": "plain"}])
    with pytest.raises(ValueError, match="holds chat messages in other rows but a str here"):
        list(load_documents(config(tmp_path, mixed).documents, build_tokenizer()))


def test_a_column_of_token_ids_is_not_read_as_chat(tmp_path):
    """A list column whose first value is not messages (pre-tokenized ids) was taken for chat, then every row
    failed with "holds chat messages in other rows but a list here", which no row did."""
    for first in ([17, 4, 9], ["a", "b"], [{"role": "user", "content": "hi"}, 3], []):  # []: the next row decides
        data = write_jsonl(tmp_path / "ids.jsonl", [{"text": first}, {"text": [4, 5]}])
        with pytest.raises(ValueError, match=r"text field 'text' holds a list of (int|str) .*expected text, or chat "
                                             r"messages"):
            list(load_documents(config(tmp_path, data).documents, build_tokenizer()))


# --------------------------------------------------------------------------------- packing

@pytest.mark.parametrize("split_documents", [False, True])
@pytest.mark.parametrize("reset_attention", [False, True])
def test_packing_invariants(tmp_path, rng, split_documents, reset_attention):
    texts = random_texts(rng, 40, hi=45)  # 5..47 tokens: some longer than S and than 42
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    cfg = config(tmp_path, data, shuffle=False, split_documents=split_documents,
                 reset_attention=reset_attention, max_length=42 if split_documents else None)
    batches = PackedBatchIterator(cfg, build_tokenizer())
    tok = batches.tokenizer
    kept = [doc_ids(tok, t) for t in texts if len(doc_ids(tok, t)) <= cfg.length_limit]
    assert 0 < len(kept) < len(texts) and batches.num_documents == len(kept)
    got = take(batches, 30)  # > 2 epochs

    stream = []
    # where documents end in the stream that runs on across epochs: a new segment starts there and only there
    ends = set(np.cumsum([len(d) for d in kept] * (30 * B * S // sum(map(len, kept)) + 2)).tolist())
    for b in got:
        ids, seg, pos, mask, tgt = (b[k] for k in ("input_ids", "segment_ids", "positions", "loss_mask", "targets"))
        assert ids.shape == seg.shape == pos.shape == mask.shape == tgt.shape == (B, S)
        assert ids.dtype == seg.dtype == pos.dtype == tgt.dtype == np.int32 and mask.dtype == np.float32
        np.testing.assert_array_equal(tgt[:, :-1], ids[:, 1:])
        for r in range(B):
            n_real = int((seg[r] > 0).sum())
            assert (seg[r, :n_real] > 0).all() and (seg[r, n_real:] == 0).all()  # padding only at the end
            assert (ids[r, n_real:] == tok.pad_token_id).all()
            assert int(real_lengths(jnp.asarray(seg))[r]) == n_real  # what the train step keeps queries to
            assert (np.diff(seg[r, :n_real]) >= 0).all() and seg[r, 0] == 1 and np.all(np.diff(np.unique(seg[r, :n_real])) == 1)
            if split_documents:
                assert n_real == S  # continuous stream: no padding
            for t in range(S):
                same_next = t + 1 < S and seg[r, t] > 0 and seg[r, t + 1] == seg[r, t]
                assert mask[r, t] == float(same_next)
                start = t == 0 or seg[r, t] != seg[r, t - 1]
                assert pos[r, t] == (t if not reset_attention else 0 if start else pos[r, t - 1] + 1)
            for t in range(1, n_real):  # a piece is a whole document, or cut only by the row's ends
                assert (seg[r, t] != seg[r, t - 1]) == (len(stream) + t in ends), (r, t)
            stream += ids[r, :n_real].tolist()
    flat = sum(kept, [])
    repeats = len(stream) // len(flat) + 1
    assert stream == (flat * repeats)[:len(stream)]  # every kept token exactly once per epoch, in order
    if not split_documents:  # whole documents: every segment is one kept document
        pieces = segments(got)
        assert pieces == (kept * (len(pieces) // len(kept) + 1))[:len(pieces)]


def test_length_filter(tmp_path, rng):
    texts = random_texts(rng, 60, lo=0, hi=40)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    batches = PackedBatchIterator(config(tmp_path, data, shuffle=False, min_length=12, max_length=30),
                                  build_tokenizer())
    lengths = np.array([len(t) + 2 if t else 0 for t in texts])  # <bos> + chars + <eos>; "" has no text
    assert batches.stats == {k: v for k, v in dict(kept=int(((lengths >= 12) & (lengths <= 30)).sum()),
                                                   too_short=int(((lengths > 0) & (lengths < 12)).sum()),
                                                   too_long=int((lengths > 30).sum()),
                                                   no_text=int((lengths == 0).sum())).items() if v}
    seen = {tuple(p) for p in segments(take(batches, 20))}
    expected = {tuple(doc_ids(batches.tokenizer, t)) for t, n in zip(texts, lengths) if 12 <= n <= 30}
    assert seen == expected


@pytest.mark.parametrize("streaming", [False, True])
def test_a_huge_document_is_found_too_long_by_its_head(tmp_path, rng, monkeypatch, streaming):
    """A 20 MB line took 7.7 GB and 40 s to tokenize whole, to be dropped as too long (a 50 MB one ran out of
    memory): the tokenizer now reads a long text's head, and the whole only where the head fits the limit."""
    texts = random_texts(rng, 20, lo=3, hi=40)
    huge = "".join(rng.choice(CHARS, size=64 * (30 + 64) * 3))  # the demo tokenizer: a token per character
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts[:10] + [huge] + texts[10:]])
    longest, call = [0], type(build_tokenizer()).__call__

    def spy(self, text, *args, **kwargs):
        longest[0] = max([longest[0]] + [len(t) for t in (text if isinstance(text, list) else [text])])
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(build_tokenizer()), "__call__", spy)
    batches = PackedBatchIterator(config(tmp_path, data, shuffle=False, max_length=30, streaming=streaming),
                                  build_tokenizer())
    seen = [tuple(p) for p in segments(take(batches, 12))]
    lengths = np.array([len(t) + 2 for t in texts])
    assert 0 < longest[0] <= 64 * (30 + 64)
    if not streaming:  # a stream counts again at every epoch
        assert batches.stats == {"kept": int((lengths <= 30).sum()), "too_long": int((lengths > 30).sum()) + 1}
    expected = [tuple(doc_ids(batches.tokenizer, t)) for t in texts if len(t) + 2 <= 30]
    assert set(seen) == set(expected) and seen[:len(expected)] == expected


def test_tokenize_reads_a_long_text_whole_where_its_head_fits_the_limit():
    class Coarse:  # a token per 100 characters: the head (64 * (10 + 64) characters) fits limit 10 + margin 64
        eos_token_id = 0

        def __call__(self, texts, add_special_tokens, return_attention_mask):
            return {"input_ids": [[7] * (len(t) // 100 + 1) for t in texts]}

    texts = ["y" * 99, "x" * 200_000]
    got = tokenize(texts, Coarse(), chat=False, limit=10)
    assert [len(ids) for ids in got] == [2, 200_000 // 100 + 2]  # + EOS: both read whole
    # a token per character: <bos> + the head (no whitespace to cut at: 64 * (10 + 64) characters) + EOS
    assert [len(ids) for ids in tokenize(texts, build_tokenizer(), chat=False, limit=10)] == [99 + 2, 4736 + 2]


# --------------------------------------------------------------------------------- shuffle

def test_shuffle_is_deterministic_per_seed_and_epoch(tmp_path, rng):
    texts = random_texts(rng, 30, hi=12)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    tokenizer = build_tokenizer()

    def documents(seed, n=60):
        return segments(take(PackedBatchIterator(config(tmp_path, data, seed=seed), tokenizer), 15))[:n]

    a, b, c = documents(0), documents(0), documents(1)
    assert a == b and a != c
    all_docs = sorted(doc_ids(tokenizer, t) for t in texts)
    assert sorted(a[:30]) == sorted(a[30:]) == sorted(c[:30]) == all_docs  # each epoch: every doc once
    assert a[:30] != a[30:]  # a new order every epoch


# --------------------------------------------------------------------------------- resume

@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("split_documents", [False, True])
def test_restore_continues_exactly(tmp_path, rng, streaming, split_documents):
    texts = random_texts(rng, 25, hi=45)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    cfg = config(tmp_path, data, streaming=streaming, shuffle_buffer=8, split_documents=split_documents,
                 max_length=60 if split_documents else None, seed=3)
    tokenizer = build_tokenizer()
    uninterrupted = take(PackedBatchIterator(cfg, tokenizer), 14)  # ~3 epochs

    first = PackedBatchIterator(cfg, tokenizer)
    assert_batches_equal(take(first, 5), uninterrupted[:5])
    saved = json.loads(json.dumps(first.state()))
    assert saved["batches"] == 5
    resumed = PackedBatchIterator(cfg, tokenizer)
    resumed.restore(saved)
    assert_batches_equal(take(resumed, 9), uninterrupted[5:])
    assert resumed.epoch >= 2

    with pytest.raises(ValueError, match="seed"):
        PackedBatchIterator(config(tmp_path, data, streaming=streaming, split_documents=split_documents,
                                   max_length=60 if split_documents else None, seed=4), tokenizer).restore(saved)


def test_restore_names_a_hand_edited_state_instead_of_a_traceback_or_a_silent_skip(tmp_path, rng):
    """A checkpoint's data item edited by hand: a missing field or a list was a KeyError or AttributeError
    traceback, an index past the documents started another epoch and a negative offset packed a document's last
    tokens, both silently. Now each is a ValueError naming the field (train.loop says which step)."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_texts(rng, 12, hi=45)])
    cfg = config(tmp_path, data, seed=3)
    tokenizer = build_tokenizer()
    first = PackedBatchIterator(cfg, tokenizer)
    take(first, 2)
    saved = json.loads(json.dumps(first.state()))
    edits = {"index": (10**9, rf"index 1000000000 is past its {first.num_documents} documents"),
             "offset": (-5, r"offset -5 is not an int >= 0"), "epoch": (None, r"epoch None is not an int >= 0"),
             "batches": ("3", r"batches '3' is not an int >= 0"), "config": ([1], r"config \[1\] is not an object"),
             "offset ": (10**6, r"offset 1000000 is past its document \(\d+ tokens\)")}
    for field, (value, message) in edits.items():
        with pytest.raises(ValueError, match=rf"^the data state is not one a run saved: its {message}$"):
            PackedBatchIterator(cfg, tokenizer).restore(dict(saved, **{field.strip(): value}))
    for item in ([1], 1):  # an int equal to the version was an AttributeError
        with pytest.raises(ValueError, match=r"^the data state is not one a run saved: " + re.escape(str(item))
                                             + " is not an object$"):
            PackedBatchIterator(cfg, tokenizer).restore(item)
    resumed = PackedBatchIterator(cfg, tokenizer)
    resumed.restore(saved)
    assert_batches_equal(take(resumed, 1), take(first, 1))


def test_stream_matches_in_memory_without_shuffle(tmp_path, rng):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_texts(rng, 20, hi=45)])
    tokenizer = build_tokenizer()
    memory = PackedBatchIterator(config(tmp_path, data, shuffle=False), tokenizer)
    stream = PackedBatchIterator(config(tmp_path, data, shuffle=False, streaming=True), tokenizer)
    assert memory.num_documents is not None and stream.num_documents is None
    assert_batches_equal(take(memory, 8), take(stream, 8))


# --------------------------------------------------------------------------------- hosts

@pytest.mark.parametrize("process_count", [2, 4])
def test_hosts_get_disjoint_covering_slices(tmp_path, rng, process_count):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in random_texts(rng, 30)])
    tokenizer = build_tokenizer()
    single = take(PackedBatchIterator(config(tmp_path, data), tokenizer), 6)
    hosts = [take(PackedBatchIterator(config(tmp_path, data, process_index=p, process_count=process_count),
                                      tokenizer), 6) for p in range(process_count)]
    for step, whole in enumerate(single):
        for key, value in whole.items():
            parts = [h[step][key] for h in hosts]
            assert all(p.shape[0] == B // process_count for p in parts)
            np.testing.assert_array_equal(np.concatenate(parts), value, err_msg=key)


@pytest.mark.parametrize("streaming", [False, True])
def test_several_splits_are_interleaved(tmp_path, streaming):
    """The paper reads Nemotron-Math-v2's high_part00..02: comma-separated splits interleave round robin."""
    import datasets

    parts = {"p0": ["a0", "a1", "a2"], "p1": ["b0"], "p2": ["c0", "c1"]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in parts.items()}).save_to_disk(
        str(tmp_path / "saved"))
    spec = DocumentSpec(str(tmp_path / "saved"), split="p0,p1,p2", streaming=streaming)
    assert list(load_documents(spec)) == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert list(load_documents(DocumentSpec(str(tmp_path / "saved"), split="p1"))) == ["b0"]
    with pytest.raises(ValueError, match="split 'p3' not in"):
        list(load_documents(DocumentSpec(str(tmp_path / "saved"), split="p0,p3")))
