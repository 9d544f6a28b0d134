"""Turn text or JSONL files into token shards, on many processes, with quality filters:

    python -m torchtitan_ext.data.prepare --input 'data/*.jsonl' --output-dir data/shards --tokenizer byte \\
        --workers 8 --filters heuristics,minhash,ppl --ppl-checkpoint outputs/debug

Each .txt (or other) file is one document; each JSONL line is one document (its ``--text-key`` string).
Documents are followed by the tokenizer's end-of-text id. Shards hold ``--shard-tokens`` tokens (the last
may be shorter); the first ``--val-shards`` go to ``val_*.bin``, the rest to ``train_*.bin``. Options that
leave a split empty (no token left for training, or none at all) are refused once the input is read, and the
shards written so far removed.

Workers tokenize and apply the heuristics to chunks of documents in input order; the near-duplicate index
and the writer run in the main process, so the output does not depend on ``--workers``. Each shard is
written atomically and followed by ``prepare_state.npz`` (records consumed, tokens carried into the next
shard, duplicate index, counts, as plain arrays and JSON: reading it runs no code, unlike the pickled
``prepare_state.pkl`` of earlier versions, which is refused unread): a run that crashed, was interrupted
(Ctrl-C: exit 130) or stopped on bad input (a bad record, a truncated .gz / .zst, a full disk: exit 2)
continues from the last shard when started again with the same arguments. With ``ppl`` in ``--filters``, a
first pass scores the documents that survive the earlier filters (cached in ``ppl_scores.npy``) and the
second pass writes. Filters (in the order given) are described in ``torchtitan_ext.data.filters``; the final
report lists what each removed.
"""

from __future__ import annotations

import gc
import glob
import io
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan_ext.data.filters import HeuristicRules, NearDuplicates, heuristic_reason, minhash_signature
from torchtitan_ext.data.shards import write_shard
from torchtitan_ext.data.text_sources import InputError, read_documents
from torchtitan_ext.data.tokenizers import open_tokenizer

FILTERS = ("heuristics", "minhash", "ppl")
STATE = "prepare_state.npz"
OLD_STATE = "prepare_state.pkl"  # earlier versions' pickle: never read, since unpickling runs code
logger = logging.getLogger(__name__)


class Progress:
    """Documents, tokens and bytes done; ``show(progress, final)`` is called at most every half second and
    once at the end."""

    def __init__(self, total_bytes: int, label: str, show: Callable[[Progress, bool], None] | None = None):
        self.total, self.label, self.start, self.last, self.show = total_bytes, label, time.time(), 0.0, show
        self.docs = self.tokens = self.bytes = 0

    def update(self, docs: int, tokens: int, nbytes: int, final: bool = False) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        if self.show is not None and (final or time.time() - self.last >= 0.5):
            self.last = time.time()
            self.show(self, final)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(time.time() - self.start, 1e-9)


@dataclass
class Hooks:
    """What the caller supplies: console lines, progress display, the shard writer and the ``ppl`` filter's
    scorer (texts -> mean next-token loss each)."""

    warn: Callable[[str], None] = logger.warning
    note: Callable[[str], None] = logger.info
    show: Callable[[Progress, bool], None] | None = None
    write: Callable = write_shard
    ppl_scorer: Callable[[list[str]], np.ndarray] | None = None


def documents(files: list[Path], text_key: str, fmt: str = "auto", warn: Callable[[str], None] = logger.warning
              ) -> Iterator[str]:
    """Every document of ``files`` in order (``data/text_sources.py`` reads each format); an empty file is
    skipped with one warning line."""
    for path in files:
        if path.is_file() and path.stat().st_size == 0:
            warn(f"warning: {path}: empty file, skipped")
            continue
        yield from read_documents(path, text_key, fmt)


def input_bytes(path: Path) -> int:
    """The bytes of an input file, or of every file in an input folder (a datasets folder)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


class ShardWriter:
    """Buffers tokens and writes full shards: val_000000.bin ... then train_000000.bin ..."""

    def __init__(self, out: Path, shard_tokens: int, val_shards: int, write: Callable = write_shard):
        self.out, self.shard_tokens, self.val_left, self.write = out, shard_tokens, val_shards, write
        self.buf: list[np.ndarray] = []
        self.buffered = self.written = 0
        self.index = {"val": 0, "train": 0}

    def add(self, tokens: np.ndarray) -> bool:
        """Buffer ``tokens``; True when a shard was written."""
        self.buf.append(tokens)
        self.buffered += len(tokens)
        full = self.buffered >= self.shard_tokens
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)
        return full

    def _flush(self, n: int) -> None:
        data = np.concatenate(self.buf)
        split = "val" if self.val_left > 0 else "train"
        self.val_left -= split == "val"
        self.write(self.out / f"{split}_{self.index[split]:06d}.bin", data[:n])
        self.index[split] += 1
        self.written += n
        self.buf, self.buffered = [data[n:]], len(data) - n

    def close(self) -> None:
        if self.buffered:
            self._flush(self.buffered)


# --- worker side: tokenize and apply the heuristics -------------------------------------------------------
_TOK = None
_RULES: HeuristicRules | None = None
_SIGNATURES = False


def _init_worker(tok_spec: tuple, rules: HeuristicRules | None, signatures: bool) -> None:
    global _TOK, _RULES, _SIGNATURES
    if mp.parent_process() is not None:  # a pool worker: Ctrl-C is the main process's to handle (it ends
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool), never a KeyboardInterrupt traceback here
    _TOK = open_tokenizer(*tok_spec)
    _RULES, _SIGNATURES = rules, signatures


def _process(texts: list[str]) -> list[tuple[np.ndarray | None, str | None, np.ndarray | None]]:
    """(tokens with the end-of-text, None, MinHash signature when needed) or (None, reason, None) per
    document: the costly per-document work, done in the workers."""
    out = []
    eot = np.array([_TOK.eot_id], dtype=np.int32)
    for text, ids in zip(texts, _TOK.encode_batch(texts), strict=True):
        ids = np.asarray(ids, dtype=np.int32)
        reason = heuristic_reason(text, len(ids), _RULES) if _RULES is not None else None
        if reason:
            out.append((None, reason, None))
        else:
            out.append((np.concatenate([ids, eot]), None, minhash_signature(text) if _SIGNATURES else None))
    return out


def _save_state(out: Path, writer: ShardWriter, state: dict, **changes) -> None:
    """``state`` with ``changes`` and the writer's position, written atomically."""
    record = {**state, **changes, "index": dict(writer.index), "val_left": writer.val_left,
              "written": writer.written}
    dedup, carry = record.pop("dedup"), record.pop("carry")
    record["dedup_threshold"] = None if dedup is None else dedup.threshold
    arrays = {"carry": np.asarray(carry, np.int32), **(dedup.arrays() if dedup is not None else {}),
              "record": np.frombuffer(json.dumps(record).encode(), np.uint8)}
    tmp = out / (STATE + ".tmp")
    try:
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # through bytes: numpy's own file writes lose the errno (a full disk)
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
        os.replace(tmp, out / STATE)
    except BaseException as e:  # a full disk, Ctrl-C: the previous state stays, no partial file
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # write() and close() do not say which file
            raise OSError(e.errno, e.strerror or str(e), str(out / STATE)) from None
        raise


def _pipeline(files, args, pool, skip: int, dedup: NearDuplicates | None, removed: dict, progress: Progress,
              warn: Callable[[str], None]) -> Iterator[tuple[int, str, np.ndarray]]:
    """(record number, text, tokens) of every document after ``skip`` records that passes the heuristics
    and the duplicate filter, in input order; ``removed`` counts the rest."""
    docs = documents(files, args.text_key, args.format, warn if skip == 0 else (lambda m: None))
    for _ in range(skip):
        next(docs, None)
    record = skip
    pending: deque[list[str]] = deque()  # the texts of the chunks handed to the workers, in order
    failure: list[InputError] = []  # a bad record: raised once every record before it is written

    def work() -> Iterator[list[str]]:
        chunk: list[str] = []
        try:
            for doc in docs:
                chunk.append(doc)
                if len(chunk) == args.chunk_docs:
                    pending.append(chunk)
                    yield chunk
                    chunk = []
        except InputError as e:
            failure.append(e)
        if chunk:
            pending.append(chunk)
            yield chunk

    results = pool.imap(_process, work()) if pool is not None else map(_process, work())
    for res in results:
        texts = pending.popleft()
        for text, (tokens, reason, signature) in zip(texts, res, strict=True):
            record += 1
            progress.update(1, 0 if tokens is None else len(tokens), len(text.encode("utf-8")))
            if reason is not None:
                removed[f"heuristics/{reason}"] = removed.get(f"heuristics/{reason}", 0) + 1
                continue
            if dedup is not None:
                dup = dedup.check(text, signature)
                if dup is not None:
                    removed[f"minhash/{dup}"] = removed.get(f"minhash/{dup}", 0) + 1
                    continue
            yield record, text, tokens
    if failure:
        raise failure[0]


def check(opts) -> tuple[list[Path], list[str]]:
    """(input files, filters in order); InputError (one line) for what cannot run."""
    files = sorted({Path(f) for pattern in opts.input for f in glob.glob(str(Path(pattern).expanduser()))})
    if not files:
        raise InputError(f"--input {' '.join(opts.input)}: no such files")
    filters = [f for f in opts.filters.split(",") if f]
    bad = [f for f in filters if f not in FILTERS]
    if bad:
        raise InputError(f"--filters: unknown filter {bad[0]!r}; valid: {', '.join(FILTERS)}")
    for name, value, low in (("--shard-tokens", opts.shard_tokens, 1), ("--workers", opts.workers, 1),
                             ("--chunk-docs", opts.chunk_docs, 1)):
        if value < low:
            raise InputError(f"{name} {value}: expected >= {low}")
    if "ppl" in filters and filters[-1] != "ppl":
        raise InputError("--filters: ppl must come last (its percentile is taken over what the others keep)")
    if "ppl" in filters and not opts.ppl_checkpoint:
        raise InputError("--filters ppl needs --ppl-checkpoint (a dump folder of ours)")
    if not 0 < opts.ppl_percentile <= 100:
        raise InputError(f"--ppl-percentile {opts.ppl_percentile}: expected within (0, 100]")
    return files, filters


def prepare(opts, hooks: Hooks | None = None) -> dict | None:
    """Write the shards of ``opts`` (the command line's arguments, ``python -m torchtitan_ext.data.prepare -h``);
    the final report ({documents_kept, removed, tokens, train_shards, val_shards, mb_per_s, workers[,
    ppl_threshold_nats]}), or None when the folder was already complete."""
    hooks = hooks or Hooks()
    files, filters = check(opts)
    if "ppl" in filters and hooks.ppl_scorer is None:
        raise InputError("--filters ppl: no perplexity scorer was given")
    tok_spec = (opts.tokenizer, opts.tokenizer_vocab_size, Path(opts.cache_dir).expanduser())
    open_tokenizer(*tok_spec)  # a bad tokenizer fails here, in one line, before any worker starts
    rules = HeuristicRules(opts.min_tokens, opts.max_tokens, opts.max_symbol_ratio, opts.max_repeat_ratio) \
        if "heuristics" in filters else None
    out = Path(opts.output)
    created = [d for d in (out, *out.parents) if not d.exists()]  # the folders this run makes, innermost first
    out.mkdir(parents=True, exist_ok=True)
    total_bytes = sum(input_bytes(f) for f in files)
    ctx = mp.get_context("spawn" if sys.platform == "darwin" else "fork")
    init = (tok_spec, rules, "minhash" in filters)
    pool = None
    if opts.workers > 1:
        # Workers start with SIGINT ignored (also before their initializer runs): a Ctrl-C reaches the
        # terminal's whole process group, and only the main process acts on it. SIGTERM keeps its default
        # action in them whatever handler this process has (a trainer's stop request): ``Pool.terminate``
        # ends a worker waiting for the task queue's lock, which it holds, by SIGTERM alone.
        previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                    signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL)}
        # A forked worker must not run the destructors of this process's garbage: an unreferenced torch
        # process group (a trainer's, a test's) hangs a child whose collector frees it (its threads were not
        # forked). So the garbage is freed here, and what lives is frozen out of the workers' collections.
        gc.collect()
        gc.freeze()
        try:
            pool = ctx.Pool(opts.workers, _init_worker, init)
        finally:
            gc.unfreeze()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    else:
        _init_worker(*init)
    try:
        return _write(opts, hooks, files, filters, pool, out, total_bytes)
    finally:
        if pool is not None:
            _end_pool(pool)
        if created and not any(out.iterdir()):  # nothing written: leave no empty folder behind
            for folder in created:
                try:
                    folder.rmdir()
                except OSError:  # something else appeared in it meanwhile: it stays
                    break


def _end_pool(pool, timeout_s: float = 15.0) -> None:
    """``pool.terminate()``, bounded. CPython's can wait for ever on its task thread when an interrupt leaves
    that thread blocked writing the next chunk into the pipe of workers that no longer read it; then the
    workers are killed and the pool's (daemon) threads are left to end with the process."""
    ender = threading.Thread(target=pool.terminate, name="prepare-pool-end", daemon=True)
    ender.start()
    ender.join(timeout_s)
    if ender.is_alive():
        for worker in pool._pool:
            worker.kill()


def _read_state(path: Path) -> dict:
    """The state :func:`_save_state` wrote, read without unpickling anything; InputError naming the file when
    it is not one (truncated, damaged, or an array numpy would have to unpickle)."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            state = json.loads(saved["record"].tobytes())
            state["carry"] = saved["carry"].astype(np.int32)
            threshold = state.pop("dedup_threshold")
            state["dedup"] = None if threshold is None else NearDuplicates.from_arrays(
                float(threshold), saved["signatures"], saved["digests"])
        missing = [k for k in ("records", "kept", "removed", "index", "val_left", "written", "done", "args")
                   if k not in state]
        if missing:
            raise KeyError(missing[0])
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not a preparation state this version wrote ({type(e).__name__}: "
                         f"{str(e).strip()[:120]}); remove it and the folder's shards, then prepare again") from None
    return state


def _resume(opts, hooks: Hooks, out: Path, writer: ShardWriter) -> dict | None:
    """The saved state of an interrupted preparation in ``out`` (or a fresh one); None when it completed.
    An earlier version's pickled state is refused unread (one line naming it)."""
    state = {"records": 0, "kept": 0, "removed": {}, "dedup": None, "carry": np.zeros(0, np.int32),
             "index": dict(writer.index), "val_left": writer.val_left, "written": 0, "done": False,
             "args": json.loads(json.dumps([opts.input, opts.tokenizer, opts.shard_tokens, opts.val_shards,
                                            opts.filters]))}
    if (out / OLD_STATE).is_file() and not (out / STATE).is_file():
        raise InputError(f"{out / OLD_STATE}: an earlier version's pickled preparation state, not read (unpickling "
                         f"a file can run code); remove it and the folder's shards, then prepare again")
    if (out / STATE).is_file():
        saved = _read_state(out / STATE)
        if saved["args"] != state["args"]:
            raise InputError(f"{out}: holds shards of another preparation ({STATE} has different --input, "
                             "--tokenizer, --shard-tokens, --val-shards or --filters); use an empty folder")
        if saved["done"]:
            hooks.note(f"{out}: already complete ({saved['written']:,} tokens)")
            return None
        state = saved
        hooks.note(f"resuming after record {state['records']:,} ({state['written']:,} tokens in shards)")
    writer.index, writer.val_left, writer.written = dict(state["index"]), state["val_left"], state["written"]
    writer.buf, writer.buffered = [state["carry"]], len(state["carry"])
    return state


def _check_splits(opts, out: Path, writer: ShardWriter, kept: int, records: int, removed: dict) -> None:
    """InputError when the options leave the training or the validation split empty (every token in
    validation shards, or no token at all), once the last document is read and before the last shard is
    written; the shards and state this preparation wrote are removed, since other options need a fresh
    folder."""
    total = writer.written + writer.buffered
    shards = -(-total // opts.shard_tokens)
    if total and opts.val_shards < shards:
        return
    gone = sum(removed.values())
    if not total:
        message = (f"--input {' '.join(opts.input)}: no tokens to write: {records:,} documents read"
                   + (f", all {gone:,} removed by --filters {opts.filters}" if gone else ""))
    else:
        message = (f"--val-shards {opts.val_shards}: the input holds {total:,} tokens from {kept:,} documents, "
                   f"{shards} shard(s) of --shard-tokens {opts.shard_tokens:,}, so no training shard would be "
                   f"left; expected --val-shards < {shards} (or a smaller --shard-tokens)")
    for split, count in writer.index.items():
        for i in range(count):
            (out / f"{split}_{i:06d}.bin").unlink(missing_ok=True)
    (out / STATE).unlink(missing_ok=True)
    raise InputError(message)


def _write(opts, hooks: Hooks, files, filters, pool, out: Path, total_bytes: int) -> dict | None:
    scores = ppl_threshold = None
    if "ppl" in filters:  # pass 1: the scores of what the earlier filters keep (cached in the folder)
        cache = out / "ppl_scores.npy"
        if cache.is_file():
            scores = np.load(cache)
        else:
            progress = Progress(total_bytes, "scoring pass", hooks.show)
            dedup = NearDuplicates(opts.minhash_threshold) if "minhash" in filters else None
            texts = [t for _, t, _ in _pipeline(files, opts, pool, 0, dedup, {}, progress, hooks.warn)]
            progress.update(0, 0, 0, final=True)
            scores = hooks.ppl_scorer(texts)
            tmp = out / "ppl_scores.tmp.npy"
            try:
                buf = io.BytesIO()
                np.save(buf, scores)  # through bytes: numpy's own file writes lose the errno (a full disk)
                tmp.write_bytes(buf.getvalue())
                os.replace(tmp, cache)
            except BaseException as e:  # a full disk, Ctrl-C: no partial cache
                tmp.unlink(missing_ok=True)
                if isinstance(e, OSError) and not e.filename:
                    raise OSError(e.errno, e.strerror or str(e), str(cache)) from None
                raise
        ppl_threshold = float(np.percentile(scores, opts.ppl_percentile)) if len(scores) else 0.0
    writer = ShardWriter(out, opts.shard_tokens, opts.val_shards, hooks.write)
    state = _resume(opts, hooks, out, writer)
    if state is None:
        return None
    dedup = state["dedup"] or (NearDuplicates(opts.minhash_threshold) if "minhash" in filters else None)
    removed: dict[str, int] = dict(state["removed"])
    kept = state["kept"]
    progress = Progress(total_bytes, "prepare", hooks.show)
    for record, _, tokens in _pipeline(files, opts, pool, state["records"], dedup, removed, progress, hooks.warn):
        if scores is not None:
            i = kept + sum(v for k, v in removed.items() if k.startswith("ppl/"))
            if scores[i] > ppl_threshold:
                removed["ppl/above_percentile"] = removed.get("ppl/above_percentile", 0) + 1
                continue
        kept += 1
        if writer.add(tokens):
            _save_state(out, writer, state, records=record, kept=kept, removed=removed, dedup=dedup,
                        carry=np.concatenate(writer.buf))
    _check_splits(opts, out, writer, kept, state["records"] + progress.docs, removed)
    writer.close()
    progress.update(0, 0, 0, final=True)
    _save_state(out, writer, state, records=progress.docs + state["records"], kept=kept, removed=removed,
                dedup=None, carry=np.zeros(0, np.int32), done=True)
    report = {"documents_kept": kept, "removed": removed, "tokens": writer.written,
              "train_shards": writer.index["train"], "val_shards": writer.index["val"],
              "mb_per_s": round(progress.mb_per_s, 3), "workers": opts.workers}
    if ppl_threshold is not None:
        report["ppl_threshold_nats"] = ppl_threshold
    return report
