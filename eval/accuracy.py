"""Pass@1 of dense, training-free baselines and KVpop checkpoints across compression ratios.

Like the paper's Table 1: each problem gets `n_rollouts` sampled completions; pass@1 is the
mean over problems of the fraction of correct rollouts; each method runs at every compression
ratio CR = 1 - B / context_len (B derived per CR: `KVpopConfig.budget_at`), and is reported absolute and
relative to dense (the teacher), averaged over benchmarks.

Methods (names on the command line):
  dense                      the dense checkpoint with the plain dense cache (once, no CR);
  streaming | tova | h2o     the dense checkpoint with a training-free policy at budget B
                             (`kvpop_jax.baselines`): StreamingLLM with `sinks` sinks, TOVA
                             without sinks or window, H2O 50/50 heavy/recent without sinks;
  anything else              a KVpop-exported checkpoint (kvpop-mlp, kvpop-mlstm,
                             streamingllm+, ...) decoded with its bounded cache. Its (s, w) are
                             kept and B is met by setting k = B - s - w, or, for a k = 0
                             checkpoint (StreamingLLM+), w = B - s (`KVpopConfig.retarget`);
                             or a DMS export (dms, ...), decoded with its bounded pool of
                             B entries per KV head (`DMSConfig.retarget`: the trained gates
                             and their eviction rate stay, only the capacity is B).
                             Pass `{cr: path}` as its checkpoint to use a model trained for
                             each CR instead.

Answers are checked by `eval/answers.py`; benchmarks load by `eval/benchmarks.py`.

Outputs in out_dir: accuracy.md (table), accuracy.png (bars), accuracy.json (all numbers),
samples.jsonl (every completion with its extracted answer); written under temporary names and
renamed together at the end, so a failed rerun leaves the previous report as it was. Each method × CR
is journaled as it finishes (OUT/.accuracy-journal.jsonl): the rerun of a killed run with the same
inputs decodes only the rest (`resume`); with `keep_journal` it stays after the report is written, and a rerun
of a whole report decodes nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import importlib.metadata
import json
import math
import os
import sys
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from eval.answers import check_grading_thread, is_correct, math_verify_available
from eval.benchmarks import benchmark_name, held_out_note, load_benchmark
from eval.outputs import Journal, holds_out_dir, staged_outputs
from eval.plots import check_counts, write_text
from eval.report import cr_percent, format_table, plot_bars, summarize
from kvpop_jax import __version__ as kvpop_version
from kvpop_jax import load_pretrained
from kvpop_jax.baselines import BOUNDED_METHODS as BASELINES
from kvpop_jax.baselines import BaselineConfig
from kvpop_jax.checkpoint import (chat_prompt_ids, check_checkpoint, checkpoint_tokenizer, load_tokenizer,
                                  stop_token_ids)
from kvpop_jax.config import KVpopConfig
from kvpop_jax.generate import check_seed, compile_generate, generate
from kvpop_jax.modeling import Qwen3ForCausalLM, strip_kvpop
from kvpop_jax.runtime import background_worker, source_digest
from kvpop_jax.sampling import FLOAT32_TINY, SamplingConfig

REPORT_FILES = ("samples.jsonl", "accuracy.md", "accuracy.json", "accuracy.png")  # the order they are renamed in
JOURNAL_NAME = "accuracy"  # OUT/.accuracy-journal.jsonl: the settings a killed run finished (`resume`)
CHAT_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def method_config(method: str, checkpoint_config, budget: int | None, *, sinks: int):
    """(model config, cache spec) for one method at budget B (None for dense), from the checkpoint's
    config alone: every ValueError a method can raise at B (a dense checkpoint for a KVpop
    method, a budget below s + w + the scorer's state) comes from here, before anything loads."""
    config = checkpoint_config
    if method == "dense" or method in BASELINES:
        config = dataclasses.replace(config, kvpop=None, dms=None)  # a retrofit's weights, run densely
        if method == "dense":
            return config, "dense"
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        if method == "streaming" and sinks >= budget:
            raise ValueError(f"sinks {sinks} leave StreamingLLM no recent window at B {budget}: pass sinks < B")
        return config, BaselineConfig(method, budget, sinks=sinks if method == "streaming" else 0)
    # The method's name labels its rows: a KVpop export run as 'dms' (or a DMS one as a KVpop variant) would be
    # reported under the other method's name.
    if method == "dms" and config.kvpop is not None:
        raise ValueError("method 'dms' needs a DMS export (config.json with a 'dms' block), got a KVpop one: give it "
                         "its KVpop variant's name (e.g. kvpop-mlp=DIR) to evaluate it as KVpop")
    if config.dms is not None and (method in ("kvpop", "streamingllm+") or method.startswith("kvpop-")):
        raise ValueError(f"method {method!r} names a KVpop variant but its checkpoint is a DMS export: give it as "
                         "dms=DIR")
    if config.dms is not None:
        return dataclasses.replace(config, dms=config.dms.retarget(budget, config.head_dim)), "dms"
    if config.kvpop is None:
        raise ValueError(f"method {method!r} needs a KVpop or DMS checkpoint (config.json with 'kvpop' or 'dms'), "
                         "got a dense one")
    # Knobs only training reads are reset, so exports trained differently (the mean and the max
    # target) share one compiled decode per budget.
    return dataclasses.replace(config, kvpop=config.kvpop.retarget(budget, config.head_dim).for_decoding()), "kvpop"


def method_setup(method: str, checkpoint_config, params, budget: int | None, *, sinks: int, dtype):
    """(model, params, cache spec) for one method at budget B (None for dense)."""
    config, cache = method_config(method, checkpoint_config, budget, sinks=sinks)
    if cache == "dense" or isinstance(cache, BaselineConfig):
        params = strip_kvpop(checkpoint_config, params)[1]  # a retrofit's weights without its scorers or gates
    return Qwen3ForCausalLM(config, dtype=dtype), params, cache


def _tokenizer_key(tok) -> tuple:
    """What decides how prompts encode and completions decode: the vocabulary and the special ids."""
    return (tuple(sorted(tok.get_vocab().items())), tok.bos_token_id, tok.eos_token_id)


def _shared_tokenizer(tokenizer, paths: Sequence[str]):
    """The one tokenizer every checkpoint is run with: `tokenizer` (object or path) when given, else
    the checkpoints' own, which must agree (prompts are encoded once, for every method); a
    checkpoint that ships none takes the others' with a warning."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    own = {path: checkpoint_tokenizer(path) for path in paths}
    have = [path for path in paths if own[path] is not None]
    if not have:
        raise ValueError(f"no checkpoint holds a tokenizer ({', '.join(map(repr, paths))}): copy the tokenizer "
                         "files into one (e.g. from the model it was retrofitted from), or pass tokenizer=")
    first = have[0]
    for path in have[1:]:
        if _tokenizer_key(own[path]) != _tokenizer_key(own[first]):
            raise ValueError(f"checkpoints {first!r} and {path!r} have different tokenizers (vocabulary or "
                             "BOS/EOS ids): every method is given the same encoded prompts, so compare "
                             "checkpoints that share one (or pass tokenizer= to choose it)")
    for path in paths:
        if own[path] is None:
            print(f"warning: {path!r} holds no tokenizer files; it runs with {first!r}'s", file=sys.stderr)
    return own[first]


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return chat_prompt_ids(tokenizer, prompt + CHAT_INSTRUCTION)
    return list(tokenizer(prompt)["input_ids"])


def _missing_checkpoint(checkpoints: Mapping[str, Any], method: str) -> str:
    """Why `method` has no checkpoint: dense's or a baseline's is dense=DIR; a name close to a known method is
    likely a typo (it was "no checkpoint for method 'tovaa'", the baselines unnamed); any other name is an export
    not given."""
    have = ", ".join(sorted(checkpoints)) or "none"
    if method == "dense" or method in BASELINES:
        return (f"method {method!r} {'needs' if method == 'dense' else 'runs on'} the dense checkpoint: give it as "
                f"dense=DIR in --checkpoints (have {have})")
    known = ["dense", *sorted(BASELINES), *sorted(k for k in checkpoints if k != "dense")]
    close = difflib.get_close_matches(method, known, n=1, cutoff=0.75)
    if close:
        return (f"unknown method {method!r} (did you mean {close[0]!r}?): methods are dense, the training-free "
                f"baselines ({', '.join(sorted(BASELINES))}; on the dense checkpoint) and the names of the checkpoints "
                f"given ({have}); an export not given goes in --checkpoints as {method}=DIR")
    return (f"no checkpoint named {method!r}: give the export as {method}=DIR in --checkpoints (have {have}; the "
            f"training-free baselines are {', '.join(sorted(BASELINES))})")


def _checkpoint_for(checkpoints: Mapping[str, Any], method: str, cr, budgets: Mapping[float, int] | None = None) -> str:
    """The directory `method` runs from at `cr`; `budgets` (CR -> B): a run by budget, whose errors name Bs."""
    key = "dense" if method in BASELINES else method
    if key not in checkpoints:
        raise ValueError(_missing_checkpoint(checkpoints, method))
    path = checkpoints[key]
    if isinstance(path, Mapping):
        if cr not in path:
            unit, key_of = ("B", lambda c: str(budgets[c])) if budgets is not None else ("CR", lambda c: f"{c:g}")
            raise ValueError(f"no checkpoint for {method!r} at {unit} {key_of(cr)}: given "
                             f"{', '.join(f'{method}@{key_of(c)}' for c in path)}")
        path = path[cr]
    return os.fspath(path)


def _problem_groups(encoded: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Problem indices in groups of up to `size` with equal prompt length: each length's problems in order, `size`
    at a time, the groups in order of their first problem. Problems of one length need not be consecutive: a
    benchmark of mixed lengths batches as a sorted one would (one decode per group, compiled once per shape)."""
    if size < 1:
        raise ValueError(f"problem_batch must be >= 1, got {size}")
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(encoded):
        by_length.setdefault(len(ids), []).append(i)
    groups = [same[j: j + size] for same in by_length.values() for j in range(0, len(same), size)]
    return sorted(groups, key=lambda group: group[0])


def _folder_identity(path: str | os.PathLike) -> list:
    """The files of a checkpoint or tokenizer folder as (name, size, mtime): another export written there
    since is another input. Not a hash of the weights: those can be many GB."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [os.path.realpath(path)]
    return [os.path.realpath(path)] + sorted([e.name, (st := e.stat()).st_size, st.st_mtime_ns]
                                             for e in os.scandir(path) if e.is_file())


def _problems_digest(problems: Sequence[Mapping], encoded: Sequence[Sequence[int]]) -> str:
    """A hash of a benchmark's problems and their token ids (fast for long prompts)."""
    digest = hashlib.sha256()
    for problem, ids in zip(problems, encoded, strict=True):
        digest.update(json.dumps(problem, sort_keys=True, default=str).encode())
        digest.update(np.asarray(ids, np.int64).tobytes() + b";")
    return digest.hexdigest()


def _package_version(module: str) -> str | None:
    """The installed version of the distribution of a module (`transformers.models.x` -> transformers)."""
    name = module.split(".")[0]
    for dist in (name, name.replace("_", "-")):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


# The code that decodes and grades, in the journal's key: a resumed report is not finished by other code (a `git pull`
# between the kill and the rerun).
DECODING_CODE = ("kvpop_jax", "pallas_kernels", "eval", "demo")


@holds_out_dir(*REPORT_FILES)
def run_accuracy(
    methods: Sequence[str],
    checkpoints: Mapping[str, Any],
    benchmark: str | Sequence[str],
    *,
    n_rollouts: int = 16,
    compression_ratios: Sequence[float] | None = None,
    context_len: int = 16384,
    budgets: Sequence[int] | None = None,
    max_new_tokens: int = 4096,
    sampling=None,
    out_dir: str,
    tokenizer=None,
    sinks: int = 4,
    batch_size: int | None = None,
    limit: int | None = None,
    split: str | None = None,
    chat_template: bool = False,
    seed: int = 0,
    dtype=None,
    progress: bool = True,
    problem_batch: int = 1,
    stream_prompt: bool = False,
    compile_ahead: bool = True,
    notes: bool = True,
    resume: bool = True,
    keep_journal: bool = False,
) -> list[dict]:
    """Runs every method × CR on every benchmark, writes the report, returns the table rows.

    methods: names (see the module docstring). checkpoints: method -> HF checkpoint dir (or
    {cr: dir}); "dense" serves dense and the training-free baselines. benchmark: one source
    or several (JSONL path, data file or hub name). n_rollouts samples per problem, in
    batches of `batch_size` (default n_rollouts) copies of the prompt; rollout r of problem
    i uses the same seed for every method. context_len defines CR = 1 - B / context_len.
    compression_ratios (default 0.75, 0.88) give each setting's memory B per KV head as
    round((1 - CR) * context_len); `budgets` gives the Bs themselves instead (e.g. an export's trained
    memory: 2309 for the Qwen3 CR 88% recipes), each run at CR = 1 - B / context_len. A {B: dir}
    checkpoint map (NAME@B=DIR) is then keyed by budget. A KVpop or DMS export run at a memory other
    than the one it was trained with is named (stderr and the report): `retarget` changes its k.
    tokenizer: object or path; default: the checkpoints' own, which must agree (checkpoints whose
    tokenizers differ are refused; one without a tokenizer runs with the others', with a warning).
    chat_template: wrap prompts in the tokenizer's chat template with the \\boxed{}
    instruction. sampling: a SamplingConfig (default: the paper's 0.6 / 0.95 / 20 / 0).
    problem_batch: with n_rollouts = 1, decode up to this many problems of equal prompt length as one
    batch, consecutive or not (`_problem_groups`; refused above 1 with more rollouts: those batch one problem's
    rollouts); the batch whose first problem is i uses the key of problem i. Records and samples keep the
    benchmark's order.
    stream_prompt: the training-free baselines (streaming, tova, h2o) read the prompt token by token
    past their budget (`generate(stream_prompt=True)`), deciding every eviction with only the
    attention seen so far, as over a generated trace; default: one-shot compression after a dense
    prefill (kvpress's convention; they then see every prompt query, the question's included).
    KVpop and DMS always prefill in parallel, which equals their token-by-token decode.
    compile_ahead: while one method × CR decodes, a background thread compiles the next one's first
    decode program (`generate.compile_generate`); the same programs run
    either way, so the results are identical, and XLA's single-core compiles overlap the decodes.
    resume: a run killed in out_dir left the settings it finished in a journal (`eval.outputs.Journal`,
    OUT/.accuracy-journal.jsonl); a rerun with the same inputs (methods, CRs, problems, checkpoint files,
    sampling, ...) decodes only the others, and writes the report an unbroken run writes. False: decode all.
    keep_journal: keep the journal once the report is written (default: removed), so that a rerun with the same
    inputs decodes nothing and writes the same report again (the demo recipe's reruns after a later crash).
    notes: print on stderr each export run at a memory other than its trained one (`accuracy.md` names them
    either way; the demo recipe, which trains once and runs at two budgets, says it once itself).
    """
    sampling = sampling or SamplingConfig()
    dtype = dtype or jnp.float32
    # Every input is checked before the first decode: a bad CR or checkpoint of the last method
    # must not surface after hours of the first one's rollouts.
    check_counts(problem_batch=problem_batch, n_rollouts=n_rollouts, context_len=context_len,
                 max_new_tokens=max_new_tokens, batch_size=1 if batch_size is None else batch_size)
    seed = check_seed(seed, "seed")  # jax.random.key would refuse it only at the first rollout
    if n_rollouts > 1 and problem_batch > 1:  # it was ignored without a word
        raise ValueError(f"problem_batch {problem_batch} batches problems of one rollout each; with n_rollouts "
                         f"{n_rollouts} a batch holds one problem's rollouts (batch_size): pass problem_batch 1")
    check_grading_thread()  # is_correct would refuse it only after the first problem's decode
    if n_rollouts > 1 and sampling.temperature < FLOAT32_TINY:  # n identical decodes, reported as a pass@1 over n
        raise ValueError(f"temperature {sampling.temperature:g} is greedy decoding: the n_rollouts {n_rollouts} "
                         "completions of a problem would be identical; pass n_rollouts 1")
    methods = list(dict.fromkeys(methods))
    if not methods:
        raise ValueError("no methods given")
    named_baselines = sorted(set(checkpoints) & set(BASELINES))
    if named_baselines:
        raise ValueError(f"checkpoints given for {named_baselines}: the training-free baselines run on the dense "
                         "checkpoint (dense=DIR); name a trained export after its own method (e.g. kvpop-mlstm=DIR)")
    keyed_by_budget = budgets is not None
    if budgets is not None and compression_ratios is not None:
        raise ValueError("give compression_ratios or budgets, not both (a budget B is the CR 1 - B / context_len)")
    if budgets is not None:
        for b in budgets:
            if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not 1 <= b < context_len:
                raise ValueError(f"budgets must be ints in [1, context_len {context_len}) (memory per KV head), "
                                 f"got {b!r}")
        compression_ratios = [1.0 - int(b) / context_len for b in budgets]
    elif compression_ratios is None:
        compression_ratios = (0.75, 0.88)
    crs = list(dict.fromkeys(float(cr) for cr in compression_ratios))
    if not crs and any(m != "dense" for m in methods):
        raise ValueError(f"no {'budgets' if keyed_by_budget else 'compression ratios'} given")
    budgets = {cr: KVpopConfig.budget_at(cr, context_len) for cr in crs}  # CR in [0, 1): checked here
    by_budget: dict[int, float] = {}
    for cr, budget in budgets.items():  # two CRs at one B would decode the same setting twice, in rows labelled alike
        if budget in by_budget:
            raise ValueError(f"compression ratios {by_budget[budget]:g} and {cr:g} both give B {budget} at context_len "
                             f"{context_len}: give each budget once")
        by_budget[budget] = cr
    checkpoints = _budget_keys(checkpoints, by_budget, keyed_by_budget=keyed_by_budget)
    settings = [(m, None) if m == "dense" else (m, cr) for m in methods for cr in ([None] if m == "dense" else crs)]
    configs: dict[str, Any] = {}
    for method, cr in settings:  # every checkpoint is a local directory: checked now, never looked up on a hub
        path = _checkpoint_for(checkpoints, method, cr, budgets if keyed_by_budget else None)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint of {method!r} {path!r}: "
                                    + ("a file; give the folder that holds it" if os.path.isfile(path) else
                                       "no such directory"))
        if path not in configs:
            configs[path] = check_checkpoint(path)  # config.json and the weights' headers
        try:
            method_config(method, configs[path], None if cr is None else budgets[cr], sinks=sinks)
        except ValueError as e:
            at = "" if cr is None else f" at CR {cr:g} (B {budgets[cr]} of context_len {context_len})"
            raise ValueError(f"method {method!r}{at} with checkpoint {path!r}: {e}") from None
    retargeted = _retargeted(settings, checkpoints, configs, budgets)
    sources = [benchmark] if isinstance(benchmark, str) else list(benchmark)
    benchmarks: dict[str, list[dict]] = {}
    named: dict[str, str] = {}
    for source in sources:
        name = benchmark_name(source)
        if name in named:
            if source.startswith("demo:") and named[name].startswith("demo:"):
                raise ValueError(f"benchmarks {named[name]!r} and {source!r} are the same generated problems "
                                 f"({name}): give each spec once")
            raise ValueError(f"benchmarks {named[name]!r} and {source!r} share the name {name!r} that reports, "
                             "samples and records are keyed by: rename one of the files")
        named[name] = source
        benchmarks[name] = load_benchmark(source, split=split, limit=limit, progress=progress)
    # Said now, not after the decodes: a train-split spec scores what the demo models learned from.
    not_held_out = [note for note in map(held_out_note, named.values()) if note is not None]
    for line in not_held_out:
        print(f"warning: {line}", file=sys.stderr)
    tok = _shared_tokenizer(tokenizer, list(configs))
    if chat_template and not getattr(tok, "chat_template", None):  # transformers' error was a paragraph
        where = (f"in {os.fspath(tokenizer)}" if isinstance(tokenizer, (str, os.PathLike)) else
                 "given" if tokenizer is not None else f"of {', '.join(configs)}")
        raise ValueError(f"chat_template: the tokenizer {where} has no chat template")
    encoded = {b: [_encode(tok, p["prompt"], chat_template) for p in probs] for b, probs in benchmarks.items()}
    top = max(max(ids, default=0) for enc in encoded.values() for ids in enc)
    for path, config in configs.items():
        if top >= config.vocab_size:
            users = sorted({m for m, cr in settings if _checkpoint_for(checkpoints, m, cr) == path})
            raise ValueError(f"the prompts encode to token id {top}, outside the vocabulary [0, {config.vocab_size}) "
                             f"of {path!r} (methods {users}): its tokenizer is not the one it was trained with")
    longest = max(len(ids) for enc in encoded.values() for ids in enc) + max_new_tokens
    for cr, budget in budgets.items():
        if budget >= longest and any(m != "dense" for m in methods):
            if keyed_by_budget:
                raise ValueError(f"budget {budget} is not below the longest prompt plus max_new_tokens ({longest} "
                                 f"tokens): nothing would be evicted; give budgets below {longest}")
            raise ValueError(f"CR {cr:g} of context_len {context_len} is a budget of {budget} KV entries, more than "
                             f"the longest prompt plus max_new_tokens ({longest} tokens): nothing would be evicted. "
                             "Set context_len to the length the CR should be taken of (e.g. the prompt length)")
    for path, config in configs.items():  # RoPE runs past it, but the model never trained there
        if longest > config.max_position_embeddings:
            print(f"warning: prompts plus max_new_tokens reach {longest} tokens, beyond the "
                  f"max_position_embeddings {config.max_position_embeddings} of {path!r}", file=sys.stderr)
    for line in retargeted if notes else ():  # once every input is checked: a refused run has nothing to note
        print(f"note: {line}", file=sys.stderr)
    batch = int(batch_size or n_rollouts)

    # Each setting's results are journaled as it finishes: a killed run's rerun decodes only the rest.
    setting_paths = [_checkpoint_for(checkpoints, method, cr) for method, cr in settings]
    stop_ids = {path: stop_token_ids(path, config) for path, config in configs.items()}  # read once per checkpoint
    inputs = dict(settings=settings, budgets=sorted(budgets.items()), context_len=context_len, n_rollouts=n_rollouts,
                  batch=batch, max_new_tokens=max_new_tokens, sampling=dataclasses.asdict(sampling), seed=seed,
                  sinks=sinks, stream_prompt=stream_prompt, problem_batch=problem_batch, dtype=str(jnp.dtype(dtype)),
                  # which checkpoint serves which setting (two exports swapped are other inputs), as it is on disk
                  checkpoints=[[*setting, _folder_identity(path)] for setting, path in zip(settings, setting_paths)],
                  eos=stop_ids,
                  tokenizer=[type(tok).__name__, tok.eos_token_id, _package_version(type(tok).__module__),
                             _folder_identity(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None],
                  benchmarks={b: _problems_digest(benchmarks[b], encoded[b]) for b in benchmarks},
                  checker=[math_verify_available(), _package_version("math_verify")],
                  # XLA's flags change the last bits (e.g. FMA contraction at -O0), and so a greedy tie's winner
                  device=[jax.default_backend(), jax.devices()[0].device_kind, os.environ.get("XLA_FLAGS", "")],
                  versions=[jax.__version__, _package_version("jaxlib"), np.__version__, kvpop_version,
                            source_digest(DECODING_CODE)])
    journal = Journal(out_dir, JOURNAL_NAME, inputs, resume=resume)
    finished = {(part["method"], part["cr"]): part for part in journal.parts}
    journal.parts.clear()  # held in `finished` until each is taken into the report
    if journal.stale:
        changed = f" ({', '.join(journal.changed)})" if journal.changed else ""
        why = f"of other inputs{changed}" if resume else "passed over by resume=False (--noresume)"
        print(f"note: {journal.path} holds {journal.stale} finished method x CR settings of an earlier run {why}: "
              "replaced when this run finishes its first", file=sys.stderr)
    # A kept journal is the demo recipe's, which refuses --noresume over its trained variants: there, it goes.
    again = f"delete {journal.path}" if keep_journal else "pass resume=False (--noresume)"
    if len(finished) == len(settings):
        print(f"note: every method x CR setting of {out_dir} is done for these inputs: the report is written again "
              f"without decoding; {again} to decode them again", file=sys.stderr)
    elif finished:
        print(f"note: resuming the run killed in {out_dir}: {len(finished)} of {len(settings)} method x CR settings "
              f"are done ({journal.path}); {again} to decode them again", file=sys.stderr)
    pending = [k for k, setting in enumerate(settings) if setting not in finished]

    # The checkpoints of the settings to decode are read (and checked finite) now, not when each one's turn
    # comes; the run holds them all by its end anyway.
    needed = list(dict.fromkeys(setting_paths[k] for k in pending))
    loaded = {path: load_pretrained(path, dtype=dtype)
              for path in tqdm(needed, desc="loading checkpoints", disable=not progress or len(needed) < 2)}
    # The shape of each setting's first call: the first problem group of the first benchmark.
    first = next(iter(benchmarks))
    first_group = _problem_groups(encoded[first], problem_batch if n_rollouts == 1 else 1)[0]
    first_rows, first_len = len(first_group) * min(batch, n_rollouts), len(encoded[first][first_group[0]])

    def prepare(k: int, ahead: bool):
        """Setting k's (model, params, cache, eos); `ahead`: also compile its first decode program."""
        method, cr = settings[k]
        path = setting_paths[k]
        config, params = loaded[path]
        model, mparams, cache = method_setup(method, config, params, None if cr is None else budgets[cr],
                                             sinks=sinks, dtype=dtype)
        eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        eos |= set(stop_ids[path])  # config.json's and generation_config.json's
        eos = tuple(sorted(eos))
        if ahead:
            compile_generate(model, mparams, first_rows, first_len, max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_ids=eos, cache=cache, stream_prompt=stream_prompt and method in BASELINES)
        return model, mparams, cache, eos

    records: list[dict] = []
    cut_off: dict[tuple, list[int]] = {}  # (method, cr) -> [rollouts cut at max_new_tokens with no answer, rollouts]
    reached = dict.fromkeys(crs, 0)  # per CR: the longest prompt + completion a compressing method decoded
    total = len(settings) * sum(len(p) for p in benchmarks.values())
    # XLA compiles on one core while a decode keeps ~1.5 busy: setting k + 1 compiles in
    # this thread while setting k decodes (the same programs as without it: the results are identical).
    upcoming = None
    # Every output is staged and renamed at the end: a failed rerun leaves the old report whole.
    with staged_outputs(out_dir, REPORT_FILES) as out, open(out.path("samples.jsonl"), "w") as samples, \
            background_worker(compile_ahead, "compile-ahead") as pool:
        def take(part: dict) -> None:
            """A finished setting's results into the report."""
            records.extend(part["records"])
            samples.writelines(part["samples"])
            cut_off[(part["method"], part["cr"])] = part["cut_off"]
            if part["cr"] is not None:
                reached[part["cr"]] = max(reached[part["cr"]], part["reached"])

        bar = tqdm(total=total, desc="accuracy", disable=not progress,
                   initial=(len(settings) - len(pending)) * sum(len(p) for p in benchmarks.values()))
        for k, (method, cr) in enumerate(settings):
            if (method, cr) in finished:
                take(finished.pop((method, cr)))  # not held after: a long run's samples are large
                continue
            model, mparams, cache, eos = upcoming.result() if upcoming is not None else prepare(k, False)
            after = [j for j in pending if j > k]
            upcoming = pool.submit(prepare, after[0], True) if pool is not None and after else None
            budget = None if cr is None else budgets[cr]
            bar.set_postfix(method=method, cr=cr)
            part = dict(method=method, cr=cr, records=[], samples=[], reached=0, cut_off=[0, 0])
            for bench, problems in benchmarks.items():
                done: dict[int, tuple[dict, list[str]]] = {}  # problem -> (record, sample lines): written in order
                for group in _problem_groups(encoded[bench], problem_batch if n_rollouts == 1 else 1):
                    correct = {i: [] for i in group}
                    lines: dict[int, list[str]] = {i: [] for i in group}
                    for start in range(0, n_rollouts, batch):
                        # rows: (problem, rollout); one problem's rollouts, or one rollout of each problem
                        rows = [(i, start + r) for i in group for r in range(min(batch, n_rollouts - start))]
                        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), group[0]), start)
                        tokens, lengths = generate(model, mparams, jnp.asarray([encoded[bench][i] for i, _ in rows]),
                                                   cache=cache, max_new_tokens=max_new_tokens, sampling=sampling,
                                                   eos_ids=eos, rng=key,
                                                   stream_prompt=stream_prompt and method in BASELINES)
                        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
                        if cr is not None and cache != "dms":  # DMS's gates evict whatever B is
                            part["reached"] = max(part["reached"], *(len(encoded[bench][i]) + int(lengths[r])
                                                                     for r, (i, _) in enumerate(rows)))
                        for r, (i, rollout) in enumerate(rows):
                            problem = problems[i]
                            text = tok.decode(tokens[r, : lengths[r]].tolist(), skip_special_tokens=True)
                            ok, pred = is_correct(text, problem["answer"])
                            part["cut_off"][0] += bool(pred is None and lengths[r] >= max_new_tokens and
                                                       int(tokens[r, max_new_tokens - 1]) not in eos)
                            part["cut_off"][1] += 1
                            correct[i].append(ok)
                            lines[i].append(json.dumps(dict(method=method, cr=cr, budget=budget, benchmark=bench,
                                                            id=problem["id"], rollout=rollout, answer=problem["answer"],
                                                            extracted=pred, correct=ok, completion=text)) + "\n")
                    for i in group:
                        done[i] = (dict(method=method, cr=cr, budget=budget, benchmark=bench, id=problems[i]["id"],
                                        correct=correct[i]), lines[i])
                    bar.update(len(group))
                for i in sorted(done):  # in the benchmark's order, however the lengths were grouped
                    part["records"].append(done[i][0])
                    part["samples"].extend(done[i][1])
            take(journal.add(part))  # as a resumed run reads it back: one report either way
        bar.close()

        # The up-front check bounds completions by max_new_tokens; answers usually end far sooner.
        # A CR whose budget held every decoded sequence whole evicted nothing: it decoded as dense.
        fix = ("give budgets below it" if keyed_by_budget else
               "set context_len to the length the CR should be taken of (e.g. the prompt length)")
        unevicted = [f"CR {cr:g} (B {budgets[cr]}): the longest prompt + completion was {n} tokens, so nothing "
                     f"was evicted and its rows equal dense; {fix}"
                     for cr, n in reached.items() if 0 < n <= budgets[cr]]
        # Completions cut off before any answer score 0 whatever the method: say so, not just report 0.
        truncated = [f"{m}{'' if cr is None else f' at CR {cr:g}'}: {n} of {seen} completions reached "
                     f"max_new_tokens {max_new_tokens} with no answer extracted: too few new tokens for the "
                     "answers (raise max_new_tokens), or a method that never comes to one"
                     for (m, cr), (n, seen) in cut_off.items() if n > seen / 2]
        for line in unevicted + truncated:
            print(f"warning: {line}", file=sys.stderr)
        prompt_mode = "stream the prompt past B (--stream_prompt)" if stream_prompt else \
            "compress the prompt in one shot after a dense prefill"
        by_method: dict[str, dict] = {}
        for m, cr in settings:
            by_method.setdefault(m, {})[cr] = _checkpoint_for(checkpoints, m, cr)
        used = []  # (method, CR or None for all, checkpoint)
        for m, paths in by_method.items():
            if len(set(paths.values())) == 1:
                used.append((m, None, next(iter(paths.values()))))
            else:
                used += [(m, cr, p) for cr, p in paths.items()]
        settings_json = dict(max_new_tokens=max_new_tokens, sampling=dataclasses.asdict(sampling), seed=seed,
                             sinks=sinks, stream_prompt=stream_prompt, problem_batch=problem_batch,
                             chat_template=chat_template, limit=limit, split=split,
                             benchmarks={b: os.path.abspath(named[b]) if os.path.exists(named[b]) else named[b]
                                         for b in benchmarks},  # a local file as the checkpoints: from any folder
                             checkpoints=[dict(method=m, cr=cr, path=os.path.abspath(p)) for m, cr, p in used])
        names = list(benchmarks)
        rows = summarize(records, names)
        table = format_table(rows, names) + "".join(f"\n**Warning:** {line}.\n"
                                                   for line in not_held_out + unevicted + truncated)
        checker = "math_verify" if math_verify_available() else "normalized string compare"
        write_text(out.path("accuracy.md"),
                   f"# Accuracy (pass@1 over {n_rollouts} rollouts)\n\n"
                   f"Context length {context_len} (CR = 1 - B / {context_len}); benchmarks: "
                   f"{', '.join(f'{b} ({len(p)} problems)' for b, p in benchmarks.items())}; answers checked by "
                   f"{checker}; sampling {dataclasses.asdict(sampling)}; max_new_tokens {max_new_tokens}; "
                   f"seed {seed}; sinks {sinks}; baselines {prompt_mode}.\n\n"
                   f"Checkpoints: {', '.join(f'{m}{_cr_label(cr)} {p}' for m, cr, p in used)}.\n\n"
                   + "".join(f"Note: {line}.\n\n" for line in retargeted)
                   + table)
        write_text(out.path("accuracy.json"), json.dumps(dict(rows=rows, records=records, context_len=context_len,
                                                              n_rollouts=n_rollouts, checker=checker,
                                                              unevicted=unevicted, truncated=truncated,
                                                              not_held_out=not_held_out, retargeted=retargeted,
                                                              settings=settings_json), indent=1))
        plot_bars(rows, out.path("accuracy.png"))
    if not keep_journal:
        journal.remove()  # the report is whole: a rerun decodes again
    return rows


def _key_label(key: float) -> str:
    """A NAME@KEY key as given: a CR (0.88) or a budget B (1234567, not 1.23457e+06)."""
    return f"{int(key)}" if key >= 1 and key == int(key) else f"{key:g}"


def _budget_keys(checkpoints: Mapping[str, Any], by_budget: Mapping[int, float], *, keyed_by_budget: bool):
    """`checkpoints` with each {B: dir} map (NAME@B=DIR, under `budgets`) keyed by the CR that B is run at;
    {CR: dir} maps stay. A key that is neither one of the run's CRs nor, under `budgets`, one of its Bs is named."""
    out = dict(checkpoints)
    run = (f"budgets {', '.join(map(str, by_budget))}" if keyed_by_budget else
           f"compression ratios {', '.join(f'{cr:g}' for cr in by_budget.values())}")
    for name, paths in checkpoints.items():
        if not isinstance(paths, Mapping):
            continue
        keyed, given = {}, {}
        for key, path in paths.items():
            label = f"{name}@{_key_label(key)}"
            if float(key) >= 1:  # a budget B, not a CR
                if not keyed_by_budget:
                    raise ValueError(f"checkpoint {label}: a checkpoint per budget (NAME@B=DIR) needs "
                                     "--budgets; with compression ratios give NAME@CR=DIR (CR in [0, 1))")
                if float(key) != int(key) or int(key) not in by_budget:
                    raise ValueError(f"checkpoint {label}: no budget {_key_label(key)} in this run ({run})")
                key = by_budget[int(key)]
            elif float(key) not in by_budget.values():
                raise ValueError(f"checkpoint {label}: no CR {key:g} in this run ({run})")
            if key in keyed:
                raise ValueError(f"checkpoints {given[key]} and {label} are both for one setting of this run ({run}): "
                                 "give one")
            keyed[key], given[key] = path, label
        out[name] = keyed
    return out


def _trained_memory(config) -> tuple[int, str] | None:
    """(memory per KV head, its parts) a KVpop or DMS checkpoint was trained at; None for a dense one."""
    if config.dms is not None:
        return config.dms.budget, f"a pool of {config.dms.budget} entries, window {config.dms.window}"
    if config.kvpop is None:
        return None
    kv = config.kvpop
    memory = kv.memory(config.head_dim)
    state = f" + {memory - kv.budget} of scorer state" if memory != kv.budget else ""
    return memory, f"{kv.sinks} + {kv.window} + {kv.topk} slots{state}"


def _retargeted(settings, checkpoints, configs, budgets) -> list[str]:
    """One line per KVpop or DMS checkpoint run at a memory B other than the one it was trained at (the demo
    trains once at CR 88% and runs at 75% too; the Qwen3 recipes' memory is not round((1 - CR) * 16384))."""
    lines = []
    for method in dict.fromkeys(m for m, cr in settings if cr is not None and m not in BASELINES):
        by_path: dict[str, list[float]] = {}
        for m, cr in settings:
            if m == method:
                by_path.setdefault(_checkpoint_for(checkpoints, m, cr), []).append(cr)
        for path, crs in by_path.items():
            config = configs[path]
            trained = _trained_memory(config)
            other = [cr for cr in crs if trained is not None and budgets[cr] != trained[0]]
            if not other:
                continue
            runs = []
            for cr in other:
                run, _ = method_config(method, config, budgets[cr], sinks=0)
                knob = (f"pool {config.dms.budget} -> {run.dms.budget}" if config.dms is not None else
                        f"k {config.kvpop.topk} -> {run.kvpop.topk}" if config.kvpop.topk else
                        f"window {config.kvpop.window} -> {run.kvpop.window}")
                runs.append(f"B {budgets[cr]} at CR {cr_percent(cr)} ({knob})")
            per_setting = isinstance(checkpoints[method], Mapping)
            fix = f"{method}@{trained[0]}={path} under --budgets with {trained[0]}" if per_setting else \
                f"--budgets {trained[0]}"
            lines.append(f"{method} ({path}) was trained at memory B {trained[0]} per KV head ({trained[1]}) and runs "
                         f"at {', '.join(runs)}; {fix} runs it as trained")
    return lines


def _cr_label(cr) -> str:
    return "" if cr is None else f"@{cr:g}"


def parse_checkpoints(spec: str) -> dict[str, Any]:
    """'dense=/a,kvpop-mlp=/b,kvpop-mlp@0.88=/c' -> {'dense': '/a', 'kvpop-mlp': ...}.

    `name@CR=path` gives a per-CR checkpoint ({cr: path}, CR in [0, 1)) and `name@B=path` a per-budget one
    ({B: path}, an int B >= 1, under `budgets`); plain `name=path` serves every CR.
    """
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise ValueError(f"checkpoint spec {item!r} is not NAME=PATH, NAME@CR=PATH or NAME@B=PATH")
        name, path = item.split("=", 1)
        if not name.split("@", 1)[0]:
            raise ValueError(f"checkpoint spec {item!r} names no method (NAME=PATH)")
        if "@" in name:
            name, raw = name.split("@", 1)
            if name == "dense":
                raise ValueError(f"checkpoint spec {item!r}: dense runs once, without a CR; give it as dense=PATH")
            try:
                cr = float(raw)
            except ValueError:
                cr = math.nan
            if not (0 <= cr < 1 or (1 <= cr < math.inf and cr == int(cr))):
                raise ValueError(f"checkpoint spec {item!r}: {raw!r} is neither a compression ratio in [0, 1) "
                                 "(NAME@0.88=PATH) nor a budget, an int B >= 1 (NAME@256=PATH, with --budgets)")
            if isinstance(out.get(name), str):
                raise ValueError(f"{name!r} has both a plain and a per-CR (or per-budget) checkpoint")
            if cr in out.get(name, {}):
                raise ValueError(f"{name}@{_key_label(cr)} is given twice")
            out.setdefault(name, {})[cr] = path
        else:
            if name in out:
                raise ValueError(f"{name!r} is given twice")
            out[name] = path
    return out


__all__ = ["method_config", "method_setup", "parse_checkpoints", "run_accuracy"]
