"""A large text source read in shards, each tokenised on first need into its own cache file, in bounded memory.

    shards = plan_shards(files, kind="text", shard_bytes=4 << 20)    # pieces of files, no tokenising
    stream, val, meta = open_stream(tokenizer, files=..., kind=..., dir_path=..., ...)
    rows = stream.rows(position, count)                            # (count, block_size + 1) uint32

A shard is about ``shard_bytes`` of the files in order (:mod:`.plan`): byte ranges (pieces) cut at a blank line
(text: a piece's documents are its blank-line-separated sections) or at a line end (jsonl: a document a line), a shard
holding pieces of several small files where they are. One shard, picked by the seed, is the validation split; the
others train.

The training stream: epoch e visits the train shards in a seeded order perm(seed, e), and shard s gives ``quota[s]``
blocks in that visit, its blocks in a seeded order perm(seed, e, s), from the start again where it has fewer (some
blocks twice) and cut short where it has more (some wait for another epoch's order). A shard's quota is its words
(runs of non-whitespace bytes, counted once per cache directory and kept in its meta.json) x the validation shard's
blocks per word, so the epoch's length, and the shard and block a global position falls on, are known before any
train shard is tokenised: a resume at any position and world size continues the same stream, as :mod:`.batches`'
position contract asks, and tokens_per_epoch (N) is that length in tokens: an estimate of the source's, from one
shard. A shard that gives no block (blank jsonl text fields, say) hands its positions to the next shard of the visit
order that has blocks, which depends on the data alone.

``loader_workers`` threads tokenise the next shards of the visit order ahead of the stream (the tokenizer runs
outside Python's lock); every process on a node shares each shard's file (a file lock: one tokenises, the others wait
and read it), as they share the whole-source cache. The threads are daemons and a closed stream's build stops at its
next batch of documents (its temp file never becomes the shard's), so neither close() nor the process's exit waits
for a shard being tokenised.
"""
from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import queue
import socket
import sys
import threading
import uuid
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import filelock
import numpy as np

from raytrain_scu.config.schema import STREAM_ABOVE_BYTES
from raytrain_scu.core.data.blocks import pack_blocks, tokenize_documents
from raytrain_scu.core.data.plan import WORDS_VERSION, Piece, count_words, plan_shards, shard_documents
from raytrain_scu.errors import DataError

STREAMED_SOURCES = ("text", "jsonl")  # sources of files whose documents a byte range can be cut between
OPEN_SHARDS = 8  # shards kept open (memory-mapped) at once: the one in use, the next, one per epoch boundary
# the version of the shard plan and of what a shard's file holds: part of the cache key, so a change never reuses
# shard files cut or filled another way
STREAM_LAYOUT = 3
MIN_SHARD_BLOCKS = 2  # the fewest blocks the smallest shard's bytes may promise at the validation shard's density
QUOTA_RATIO_WARN = (0.8, 1.25)  # a shard's quota / its blocks outside this is said as a warning
STOP_CHECK_DOCS = 1024  # a loader thread's build looks for its stream's close between batches of this many documents
EXIT_JOIN_S = 10.0  # at the process's exit, how long stopped loader threads are waited for (each stops within a batch)


def use_streaming(*, source: str, fmt: str, streaming: str, max_documents: int, files: list[Path]) -> bool:
    """Whether a (resolved) source is read in shards: ``data.streaming`` on, or auto and its files hold more than
    STREAM_ABOVE_BYTES (and data.max_documents keeps them all). ``on`` for a source that cannot be is a DataError."""
    if streaming == "off":
        return False
    fits = source in STREAMED_SOURCES and fmt == "text"
    if streaming == "on" and not fits:
        raise DataError(f"data.streaming=on reads text or jsonl files of text documents; data.source={source} "
                        f"holding {fmt} data is read whole: set data.streaming=off (or auto)")
    if streaming == "on":
        return True
    return fits and max_documents == 0 and sum(f.stat().st_size for f in files) > STREAM_ABOVE_BYTES


@dataclass
class Shards:
    """The shards of one source for one tokenizer and block size, each tokenised into ``dir_path`` on first need."""

    files: list[Path]
    kind: str  # text | jsonl
    text_field: str
    pieces: list[tuple[Piece, ...]]  # plan_shards
    dir_path: Path
    block_size: int
    tokenizer: object
    quota: np.ndarray | None = None  # each shard's blocks an epoch, for the line said when a shard is tokenised
    local: threading.local = field(default_factory=threading.local, repr=False)

    def path(self, i: int) -> Path:
        return self.dir_path / f"shard_{i:06d}.bin"

    def nbytes(self, i: int) -> int:
        return sum(end - start for _, start, end in self.pieces[i])

    def _tokenizer(self):
        """The tokenizer, a copy of its own in each loader thread: a fast tokenizer is not meant to be shared."""
        if threading.current_thread() is threading.main_thread():
            return self.tokenizer
        if not hasattr(self.local, "tokenizer"):
            self.local.tokenizer = copy.deepcopy(self.tokenizer)
        return self.local.tokenizer

    def build(self, i: int, stop: threading.Event | None = None) -> Path:
        """Shard ``i``'s blocks in their cache file, tokenised now unless it exists (one process at a time, under a
        file lock; the file appears whole, by a rename). A shard too small for a block gets an empty file and a
        warning: the stream hands its positions on (:meth:`ShardStream.rows`). ``stop`` set (a loader thread's stream
        closed) abandons the build between batches of STOP_CHECK_DOCS documents: :class:`Abandoned`, no file."""
        final = self.path(i)
        if final.exists():
            return final
        with filelock.FileLock(f"{final}.lock"):
            if final.exists():  # another process built it while this one waited
                return final
            docs = shard_documents(self.files, self.pieces[i], kind=self.kind, text_field=self.text_field)
            parts = [np.zeros(0, np.uint32)]
            for k in range(0, len(docs), STOP_CHECK_DOCS):
                if stop is not None and stop.is_set():
                    raise Abandoned(f"shard {i}: its stream closed while it was being tokenised")
                parts.append(tokenize_documents(self._tokenizer(), docs[k:k + STOP_CHECK_DOCS]))
            tokens = np.concatenate(parts)
            blocks = pack_blocks(tokens, self.block_size)
            self._say_built(i, len(tokens), len(blocks))
            # unique across hosts sharing the cache's filesystem, and across this process's threads
            tmp = final.with_name(f".{final.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}")
            blocks.tofile(tmp)
            os.replace(tmp, final)
        return final

    def _say_built(self, i: int, n_tokens: int, n_blocks: int) -> None:
        """The line said once a shard is tokenised: its quota against its blocks (a warning outside
        QUOTA_RATIO_WARN, or where it has none)."""
        f, start, _ = self.pieces[i][0]
        where = f"shard {i} ({self.nbytes(i)} bytes from {self.files[f]} byte {start})"
        if n_blocks == 0:
            print(f"[raytrain_scu] warning: {where} holds {n_tokens} tokens, too few for one block of "
                  f"data.block_size + 1 = {self.block_size + 1}: the next shard of the visit order with blocks takes "
                  f"its positions", file=sys.stderr, flush=True)
            return
        if self.quota is None:  # the validation shard: it sets the quotas
            return
        ratio = self.quota[i] / n_blocks
        low, high = QUOTA_RATIO_WARN
        line = f"{where}: {n_blocks} blocks, quota {self.quota[i]} an epoch (x{ratio:.2f})"
        if low <= ratio <= high:
            print(f"[raytrain_scu] data: {line}", flush=True)
        else:
            print(f"[raytrain_scu] warning: {line}, outside [{low}, {high}]: its blocks are seen x{ratio:.2f} an "
                  f"epoch; the words-per-block density of the validation shard does not fit it", file=sys.stderr,
                  flush=True)

    def open(self, i: int) -> np.ndarray:
        """Shard ``i``'s blocks, (n_blocks, block_size + 1) uint32, memory-mapped (built first where needed)."""
        path = self.build(i)
        width = self.block_size + 1
        n_blocks = path.stat().st_size // (4 * width)
        if n_blocks == 0:  # an empty file cannot be memory-mapped
            return np.zeros((0, width), dtype=np.uint32)
        return np.memmap(path, dtype=np.uint32, mode="r", shape=(n_blocks, width))


class Abandoned(Exception):
    """A shard build stopped because its stream closed (never seen by the stream: close() drops its result)."""


class Loaders:
    """``n`` daemon threads building shards in the order submitted. A ThreadPoolExecutor's threads are not daemons:
    the process's exit would wait for a shard being tokenised (minutes at 256 MiB). :meth:`stop` drops the queued
    shards and stops the one being built at its next batch of documents."""

    def __init__(self, n: int, build):
        self.stopped = threading.Event()
        self._build = build
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"raytrain_scu-shards_{k}", daemon=True)
                        for k in range(n)]
        for t in self.threads:
            t.start()
        _LOADERS.add(self)

    def submit(self, shard: int) -> Future:
        future: Future = Future()
        self._queue.put((future, shard))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, shard = item
            if self.stopped.is_set():
                future.cancel()
                continue
            future.set_running_or_notify_cancel()
            try:
                future.set_result(self._build(shard, self.stopped))
            except BaseException as e:  # the stream raises it where it reads the shard
                future.set_exception(e)

    def stop(self) -> None:
        """Returns at once: each thread ends after the batch of documents it is tokenising."""
        self.stopped.set()
        for _ in self.threads:
            self._queue.put(None)


_LOADERS: weakref.WeakSet[Loaders] = weakref.WeakSet()


@atexit.register
def _stop_loaders() -> None:
    """At the process's exit, loader threads a stream never closed (a setup that failed, say) stop and are waited for
    (a batch of documents each): no daemon thread is left inside the tokenizer while the interpreter finalises."""
    loaders = list(_LOADERS)
    for pool in loaders:
        pool.stop()
    for pool in loaders:
        for t in pool.threads:
            t.join(EXIT_JOIN_S)


class ShardStream:
    """The training stream over the train shards (see the module's docstring). ``len()`` is the blocks of one epoch;
    :meth:`rows` the blocks at global stream positions."""

    def __init__(self, shards: Shards, *, train: np.ndarray, quota: np.ndarray, seed: int, loader_workers: int):
        self.shards, self.train, self.quota, self.seed = shards, train, quota, seed
        self.loader_workers = loader_workers
        self.epoch_blocks = int(quota[train].sum())
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._open: dict[int, np.ndarray] = {}
        self._perms: dict[tuple[int, int], np.ndarray] = {}
        self._pending: dict[int, Future] = {}
        self._on_disk: set[int] = set()  # shards seen built: prefetch looks at each file once, not every batch
        self._pool: Loaders | None = None

    def __len__(self) -> int:
        return self.epoch_blocks

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The train shards in epoch ``epoch``'s visit order, and the stream offset (within the epoch) each ends at."""
        if epoch not in self._orders:
            _keep_few(self._orders, 4)  # a step touches one or two epochs
            order = self.train[np.random.default_rng([self.seed, epoch]).permutation(len(self.train))]
            self._orders[epoch] = order, np.cumsum(self.quota[order])
        return self._orders[epoch]

    def _blocks(self, epoch: int, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Shard ``shard``'s blocks (memory-mapped) and their order in epoch ``epoch``'s visit."""
        if shard not in self._open:
            pending = self._pending.pop(shard, None)
            if pending is not None:
                pending.result()  # a loader thread's DataError is raised here
            _keep_few(self._open, OPEN_SHARDS)
            self._open[shard] = self.shards.open(shard)
        blocks = self._open[shard]
        if (epoch, shard) not in self._perms:
            _keep_few(self._perms, OPEN_SHARDS)
            self._perms[epoch, shard] = np.random.default_rng([self.seed, epoch, shard]).permutation(len(blocks))
        return blocks, self._perms[epoch, shard]

    def locate(self, position: int) -> tuple[int, int, int, int]:
        """(epoch, visit, shard, offset within the shard's visit) of a global stream position."""
        epoch, r = divmod(position, self.epoch_blocks)
        order, ends = self._order(epoch)
        visit = int(np.searchsorted(ends, r, side="right"))
        return epoch, visit, int(order[visit]), int(r - (ends[visit] - self.quota[order[visit]]))

    def rows(self, position: int, count: int, *, prefetch: bool = True) -> np.ndarray:
        """The blocks at stream positions position .. position + count - 1, (count, block_size + 1) uint32; then,
        with ``prefetch``, the next shards of the visit order are handed to the loader threads. A position whose shard
        has no block is taken by the next shard of the visit order that has: its blocks after its own quota's."""
        out = np.empty((count, self.shards.block_size + 1), dtype=np.uint32)
        for j in range(count):
            epoch, visit, shard, offset = self.locate(position + j)
            blocks, perm = self._blocks(epoch, shard)
            for _ in range(2 * len(self.train)):
                if len(blocks):
                    break
                epoch, visit = (epoch, visit + 1) if visit + 1 < len(self.train) else (epoch + 1, 0)
                shard = int(self._order(epoch)[0][visit])
                offset += int(self.quota[shard])
                blocks, perm = self._blocks(epoch, shard)
            else:
                raise DataError(f"no train shard of {self.shards.dir_path} holds a block of data.block_size + 1 = "
                                f"{self.shards.block_size + 1} tokens: lower data.block_size")
            out[j] = blocks[perm[offset % len(blocks)]]
        if prefetch:
            self.prefetch(position + count)
        return out

    def close(self) -> None:
        """Stops the loader threads, returning at once: queued shards are dropped, the one being tokenised stops at
        its next batch of documents (no file written; the next process to need it tokenises it)."""
        if self._pool is not None:
            self._pool.stop()
            self._pool = None
        self._pending.clear()

    def prefetch(self, position: int) -> None:
        """The shards of the visit ``position`` falls in and of the 2 x loader_workers visits after it, to the loader
        threads where not on disk yet (none where loader_workers is 0: each shard is then tokenised when first
        read)."""
        if self.loader_workers == 0:
            return
        if self._pool is None:
            self._pool = Loaders(self.loader_workers, self.shards.build)
        epoch, visit, _, _ = self.locate(position)
        for _ in range(2 * self.loader_workers + 1):
            shard = int(self._order(epoch)[0][visit])
            if shard not in self._open and shard not in self._pending and shard not in self._on_disk:
                if self.shards.path(shard).exists():
                    self._on_disk.add(shard)
                else:
                    self._pending[shard] = self._pool.submit(shard)
            epoch, visit = (epoch, visit + 1) if visit + 1 < len(self.train) else (epoch + 1, 0)


def _keep_few(cache: dict, n: int) -> None:
    """Room for one more entry in ``cache``: its oldest go while it holds ``n`` or more."""
    while len(cache) >= n:
        cache.pop(next(iter(cache)))


def open_stream(tokenizer, *, files: list[Path], kind: str, text_field: str, dir_path: Path, block_size: int,
                seed: int, shard_bytes: int, loader_workers: int) -> tuple[ShardStream, np.ndarray, dict]:
    """(the training stream, the validation blocks, meta) of a source read in shards. Tokenises the validation
    shard alone (it sets every train shard's quota: its words x the validation shard's blocks per word); the train
    shards wait for the stream to read them. The plan and each shard's words are kept in the directory's meta.json
    (counted by the first process to open it), which a later open checks against its own plan."""
    pieces = plan_shards(files, kind=kind, shard_bytes=shard_bytes)
    where = files[0] if len(files) == 1 else files[0].parent
    if len(pieces) < 2:
        raise DataError(f"{where}: {len(pieces)} shard(s) of data.shard_bytes={shard_bytes}; a streamed source needs "
                        f"2 or more (one validates): lower data.shard_bytes, or set data.streaming=off")
    dir_path.mkdir(parents=True, exist_ok=True)
    words = _plan_words(files, pieces, dir_path)
    shards = Shards(files=files, kind=kind, text_field=text_field, pieces=pieces, dir_path=dir_path,
                    block_size=block_size, tokenizer=tokenizer)
    val_shard = int(np.random.default_rng(seed).integers(len(pieces)))
    val = shards.open(val_shard)
    smallest = min(shards.nbytes(i) for i in range(len(pieces)))
    if len(val) / shards.nbytes(val_shard) * smallest < MIN_SHARD_BLOCKS:
        raise DataError(f"{where}: the validation shard gives {len(val)} blocks of data.block_size + 1 = "
                        f"{block_size + 1} tokens from {shards.nbytes(val_shard)} bytes, so the smallest shard "
                        f"({smallest} bytes) would give fewer than {MIN_SHARD_BLOCKS}: raise data.shard_bytes "
                        f"(now {shard_bytes}) or lower data.block_size")
    blocks_per_word = len(val) / words[val_shard]
    quota = np.array([round(blocks_per_word * w) for w in words], np.int64)
    shards.quota = quota
    train = np.array([i for i in range(len(pieces)) if i != val_shard], dtype=np.int64)
    if quota[train].sum() == 0:
        raise DataError(f"{where}: the train shards hold no words (all whitespace): nothing to train on")
    stream = ShardStream(shards, train=train, quota=quota, seed=seed, loader_workers=loader_workers)
    train_bytes = int(sum(shards.nbytes(i) for i in train))
    meta = {"streamed": True, "n_shards": len(pieces), "shard_bytes": shard_bytes, "val_shard": val_shard,
            "n_train_bytes": train_bytes, "n_train_blocks": len(stream), "n_val_blocks": len(val),
            "tokens_per_byte": round(len(stream) * (block_size + 1) / train_bytes, 6),
            "tokens_per_word": round(blocks_per_word * (block_size + 1), 6), "plan": plan_fingerprint(pieces)}
    return stream, val, meta


def plan_fingerprint(pieces: list[tuple[Piece, ...]]) -> str:
    """A short hash of a shard plan and its layout: a checkpoint keeps it, so a resume can say the plan changed."""
    return hashlib.sha256(json.dumps([STREAM_LAYOUT, pieces]).encode()).hexdigest()[:16]


def _plan_words(files: list[Path], pieces: list[tuple[Piece, ...]], dir_path: Path) -> list[int]:
    """Each shard's words (:func:`count_words`), from ``dir_path``'s meta.json, or counted and written there (under a
    file lock: one process counts, every other reads). A meta.json of another layout, plan or word definition
    (WORDS_VERSION) is a DataError."""
    meta_path = dir_path / "meta.json"
    plan = [[list(p) for p in shard] for shard in pieces]
    with filelock.FileLock(f"{meta_path}.lock"):
        if meta_path.exists():
            meta = json.loads(meta_path.read_text())
            if meta.get("layout") != STREAM_LAYOUT or meta.get("pieces") != plan:
                raise DataError(f"shard cache {dir_path} was cut by another shard plan than this run's (its "
                                f"meta.json): delete the directory")
            if meta.get("words_version") != WORDS_VERSION:
                raise DataError(f"shard cache {dir_path} counted its shards' words another way than this run "
                                f"(words_version {meta.get('words_version')} in its meta.json, {WORDS_VERSION} "
                                f"here): delete the directory")
            return meta["words"]
        words = [sum(count_words(files[f], s, e) for f, s, e in shard) for shard in pieces]
        tmp = meta_path.with_name(f".meta.json.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex}")
        tmp.write_text(json.dumps({"layout": STREAM_LAYOUT, "pieces": plan, "words": words,
                                   "words_version": WORDS_VERSION}))
        os.replace(tmp, meta_path)
    return words
