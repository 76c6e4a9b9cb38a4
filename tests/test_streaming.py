"""A text source read in shards (core/data/stream.py): each shard tokenised on first need into its own cache file, the
training stream a seeded walk over the shards that resumes at any global position and world size, the validation
shard apart from it, and a full line scan of a jsonl source before any worker starts.

The fast tests use a ~400 KB source cut into ~50 KB shards. The two slow ones use a 1 GB source written into the
test's temporary directory: a 2-worker Ray run reaches its first step within FIRST_STEP_BOUND_S with the driver's
memory within DRIVER_RSS_BOUND_MIB, and a malformed line near the end of a 1 GB jsonl is refused, naming the line,
before Ray starts, within the same bound (numbers in docs/reliability.md).
"""
import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, mlflow_runs, tiny_cfg

from raytrain_scu.core.data import stream as stream_mod
from raytrain_scu.core.data.batches import calibration_batches, train_batch
from raytrain_scu.core.data.blocks import pack_blocks, tokenize_documents
from raytrain_scu.core.data.cache import prepare_data
from raytrain_scu.core.data.scan import scan_jsonl, scan_text
from raytrain_scu.core.data.sources import _shakespeare_files
from raytrain_scu.core.data.plan import plan_shards, shard_documents
from raytrain_scu.core.data.stream import use_streaming
from raytrain_scu.errors import DataError

BLOCK = 32
SHARD_BYTES = 50_000
GB = 2**30
FIRST_STEP_BOUND_S = 120.0  # from the call to the first step's metric, a 2-worker run on a 1 GB source
DRIVER_RSS_BOUND_MIB = 512  # what the driver's resident memory may grow by over that run (the source is 1024 MiB)


@pytest.fixture(scope="module")
def tok():
    from raytrain_scu.core.model.source import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def plays() -> str:
    """Three of the bundled plays, ~400 KB: no paragraph repeats, so no two blocks of the source are equal."""
    return "".join(f.read_text() for f in _shakespeare_files("")[:3])


@pytest.fixture(scope="module")
def source(tmp_path_factory, plays) -> Path:
    p = tmp_path_factory.mktemp("streamed") / "plays.txt"
    p.write_text(plays)
    return p


def streamed(tok, path, cache_dir, *, loader_workers=0, seed=0, shard_bytes=SHARD_BYTES, kind="text"):
    return prepare_data(tok, source=kind, path=str(path), block_size=BLOCK, seed=seed, cache_dir=str(cache_dir),
                        streaming="on", shard_bytes=shard_bytes, loader_workers=loader_workers)


def batches(data, *, start: int, steps: int, world: int, batch: int, accum: int = 1) -> list[np.ndarray]:
    """Every step's blocks (x), all ranks' micro-batches in position order, from stream position ``start``."""
    out, position = [], start
    for _ in range(steps):
        rows = [train_batch(data, position=position, micro_step=m, rank=r, world_size=world, batch_size=batch,
                            seed=0)[0].numpy() for m in range(accum) for r in range(world)]
        out.append(np.concatenate(rows))
        position += batch * accum * world
    return out


def test_shards_are_cut_at_blank_lines_and_line_ends_and_cover_each_file(source, tmp_path):
    shards = plan_shards([source], kind="text", shard_bytes=SHARD_BYTES)
    raw = source.read_bytes()
    assert all(len(pieces) == 1 for pieces in shards)  # one file: a range of it each
    ranges = [pieces[0] for pieces in shards]
    assert ranges[0][1] == 0 and ranges[-1][2] == len(raw) and len(ranges) == len(raw) // SHARD_BYTES
    for (_, _, end), (_, start, _) in zip(ranges, ranges[1:]):
        assert end == start and raw[:end].endswith(b"\n") and not raw[:end].rsplit(b"\n", 2)[-2].strip()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"line {i} " * (i % 7)}) + "\n" for i in range(3000)))
    cut = plan_shards([jsonl], kind="jsonl", shard_bytes=4096)
    assert len(cut) > 10 and all(jsonl.read_bytes()[:end].endswith(b"\n") for (_, _, end), in cut)
    docs = [d for pieces in cut for d in shard_documents([jsonl], pieces, kind="jsonl", text_field="text")]
    assert docs == [f"line {i} " * (i % 7) for i in range(3000) if i % 7]  # every line once, blank text skipped


def test_small_files_share_a_shard_and_every_document_is_in_one_shard(tok, plays, tmp_path):
    """A directory of 60 files of ~1-3 KB, shards of 16 KB: each shard holds several whole files and every shard
    gives blocks (no shard per file, which would hold too few tokens for a block)."""
    paras = [p for p in re.split(r"\n\s*\n", plays) if p.strip()]
    for i in range(60):
        (tmp_path / "docs" / f"{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "docs" / f"{i:02d}.txt").write_text("\n\n".join(paras[20 * i:20 * i + 10 + i % 10]) + "\n")
    files = sorted((tmp_path / "docs").iterdir())
    shards = plan_shards(files, kind="text", shard_bytes=16_384)
    sizes = [sum(e - s for _, s, e in pieces) for pieces in shards]
    assert 3 <= len(shards) < 20 and min(sizes[:-1]) >= 16_384 and max(len(p) for p in shards) > 3
    pieces = [p for ps in shards for p in ps]
    for f, path in enumerate(files):  # each file's pieces, in order, cover it once
        spans = [(start, end) for i, start, end in pieces if i == f]
        assert spans[0][0] == 0 and spans[-1][1] == path.stat().st_size
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    docs = [d for ps in shards for d in shard_documents(files, ps, kind="text", text_field="text")]
    assert docs == [d for f in files for d in re.split(r"\n\s*\n", f.read_text()) if d.strip()]
    data = prepare_data(tok, source="text", path=str(tmp_path / "docs"), block_size=BLOCK, cache_dir=str(tmp_path),
                        streaming="on", shard_bytes=16_384, loader_workers=0)
    assert all(len(data.train.shards.open(i)) > 0 for i in range(len(shards)))


def test_a_shard_holds_the_blocks_of_tokenising_its_text_directly(tok, source, tmp_path):
    data = streamed(tok, source, tmp_path)
    shards = data.train.shards
    for i in (0, 3, len(shards.pieces) - 1):
        (_, start, end), = shards.pieces[i]
        text = source.read_bytes()[start:end].decode()
        direct = pack_blocks(tokenize_documents(tok, [d for d in re.split(r"\n\s*\n", text) if d.strip()]), BLOCK)
        np.testing.assert_array_equal(shards.open(i), direct)
    # only the validation shard and the three opened above were tokenised: the others wait for the stream
    assert len(list(Path(data.cache_path).glob("shard_*.bin"))) <= 4 < len(shards.pieces)


def test_the_stream_is_deterministic_and_resumes_at_any_position_and_world_size(tok, source, tmp_path):
    first = streamed(tok, source, tmp_path / "a")
    epoch = len(first.train)
    steps = epoch // 16 + 3  # across the first epoch's end
    straight = batches(first, start=0, steps=steps, world=2, batch=4, accum=2)
    # a fresh process's stream (its own cache, loader threads tokenising ahead): the same blocks, step for step
    ahead = streamed(tok, source, tmp_path / "b", loader_workers=2)
    again = batches(ahead, start=0, steps=steps, world=2, batch=4, accum=2)
    ahead.close()
    assert all(np.array_equal(a, b) for a, b in zip(straight, again))
    # resumed at step k's position, on 1 worker of 16 a step and on 4 workers of 2 x 2: the same steps from there
    k = steps - 5
    resumed = streamed(tok, source, tmp_path / "c")
    one = batches(resumed, start=16 * k, steps=5, world=1, batch=16)
    four = batches(resumed, start=16 * k, steps=5, world=4, batch=2, accum=2)
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(straight[k:], one, four))
    other_seed = prepare_data(tok, source="text", path=str(source), block_size=BLOCK, seed=1, cache_dir=str(tmp_path),
                              streaming="on", shard_bytes=SHARD_BYTES, loader_workers=0)
    assert not np.array_equal(train_batch(other_seed, position=0, micro_step=0, rank=0, world_size=1, batch_size=16,
                                          seed=1)[0].numpy(), straight[0])
    # setup's calibration blocks: the stream's first, read without starting the loader threads (only the loop's end
    # closes the stream)
    fresh = streamed(tok, source, tmp_path / "d", loader_workers=2)
    cal = calibration_batches(fresh, blocks=20, batch_size=8, seed=0)
    np.testing.assert_array_equal(np.concatenate([c.numpy() for c in cal]), np.concatenate(straight[:2])[:20])
    assert fresh.train._pool is None and not fresh.train._pending


def test_an_epoch_gives_each_train_shard_its_quota_and_never_the_validation_shard(tok, source, tmp_path):
    data = streamed(tok, source, tmp_path)
    s = data.train
    val_shard = data.meta["val_shard"]
    seen = {}
    for p in range(2 * len(s)):
        epoch, _, shard, offset = s.locate(p)
        seen.setdefault((epoch, shard), []).append(offset)
    assert {shard for _, shard in seen} == set(s.train.tolist()) and val_shard not in s.train
    assert all(offsets == list(range(s.quota[shard])) for (_, shard), offsets in seen.items())
    # by content too: no block of the epoch is a validation block (no paragraph of the source repeats)
    val_rows = {bytes(r) for r in np.asarray(data.val)}
    epoch_rows = s.rows(0, len(s))
    assert not any(bytes(r) in val_rows for r in epoch_rows)
    (_, vs, ve), = s.shards.pieces[val_shard]
    assert all(e <= vs or st >= ve for i, ((_, st, e),) in enumerate(s.shards.pieces) if i != val_shard)


def test_tokens_per_epoch_is_an_estimate_close_to_the_train_shards_count_and_the_same_on_every_call(tok, source,
                                                                                                   tmp_path):
    data = streamed(tok, source, tmp_path)
    s = data.train
    exact = sum(len(s.shards.open(int(i))) for i in s.train) * BLOCK
    assert data.tokens_per_epoch == len(s) * BLOCK and abs(data.tokens_per_epoch / exact - 1) < 0.05
    assert streamed(tok, source, tmp_path / "again").tokens_per_epoch == data.tokens_per_epoch
    assert data.streamed and data.meta["streamed"] and data.meta["tokens_per_byte"] > 0


def test_a_resume_refuses_an_estimate_that_changed_and_says_it_is_one():
    from raytrain_scu.core.checkpoint import check_tokens_per_epoch
    from raytrain_scu.errors import CheckpointError

    meta = {"tokens_per_epoch": 1000, "step": 4}
    kw = {"streamed": True, "plan": "abc"}
    assert check_tokens_per_epoch(meta, measured=1000, override=0, **kw) is None
    with pytest.raises(CheckpointError, match="the data now gives an estimated tokens_per_epoch=1024"):
        check_tokens_per_epoch(meta, measured=1024, override=0, **kw)
    assert check_tokens_per_epoch(meta, measured=1024, override=1000, **kw) is None


def test_auto_streams_a_source_above_the_stated_size_only(source, monkeypatch):
    files = [source]
    kw = {"source": "text", "fmt": "text", "max_documents": 0, "files": files}
    assert not use_streaming(streaming="auto", **kw)
    monkeypatch.setattr(stream_mod, "STREAM_ABOVE_BYTES", source.stat().st_size - 1)
    assert use_streaming(streaming="auto", **kw) and not use_streaming(streaming="off", **kw)
    assert not use_streaming(streaming="auto", **{**kw, "max_documents": 5})  # a subset is read whole
    assert not use_streaming(streaming="auto", **{**kw, "source": "shakespeare"})
    with pytest.raises(DataError, match="data.streaming=on reads text or jsonl files of text documents"):
        use_streaming(streaming="on", **{**kw, "fmt": "chat", "source": "jsonl"})


def test_the_scans_name_the_file_and_line_or_byte_of_a_bad_input(tmp_path, monkeypatch):
    from raytrain_scu.core.data import scan

    monkeypatch.setattr(scan, "SCAN_CHUNK_BYTES", 256)  # many chunks: a line number counted across them
    good = [json.dumps({"text": f"doc {i}", "n": i}) for i in range(200)]
    for bad, lineno, what in ((b'{"text": oops}', 150, "not a JSON object"),
                              (b'{"body": "x"}', 7, "no field 'text'"),
                              (b'{"text": 5}', 199, "is int, not a string"),
                              (b'[1, 2]', 60, "not an object")):
        lines = [g.encode() for g in good]
        lines[lineno - 1] = bad
        f = tmp_path / "d.jsonl"
        f.write_bytes(b"\n".join(lines) + b"\n")
        with pytest.raises(DataError, match=re.escape(f"{f}:{lineno}: ") + ".*" + re.escape(what)):
            scan_jsonl([f], "text")
    f.write_bytes(b"\n".join(g.encode() for g in good[:50]) + b"\n\n  \n" + b"\n".join(g.encode() for g in good))
    scan_jsonl([f], "text")  # blank lines are no documents, and no error
    t = tmp_path / "t.txt"
    t.write_bytes(b"fine text\n" * 100 + b"bad \xff here\n")
    with pytest.raises(DataError, match=re.escape(f"{t}:101: not UTF-8 text: undecodable byte 0xff at byte offset "
                                                  f"1004")):
        scan_text([t])


def test_the_loop_resumed_on_a_streamed_source_ends_as_the_uninterrupted_run(source, tmp_path):
    """The real loop in this process (rank 0 of one, LocalHooks): 4 steps straight, then the same run resumed from
    its checkpoint of step 2 in a fresh cache (the shards tokenised anew, by a loader thread): the same adapter and
    the same training loss at steps 3 and 4, bit for bit, and the same estimated tokens_per_epoch."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from raytrain_scu.config.paths import RunPaths
    from raytrain_scu.worker.hooks import LocalHooks
    from raytrain_scu.worker.loop import run_loop

    def loop(cache: str) -> LocalHooks:
        cfg = tiny_cfg(tmp_path, "streamed", "scaling.num_workers=1", "tracking.enabled=false", "data.source=text",
                       f"data.path={source}", "data.max_documents=0", "data.streaming=on", "data.shard_bytes=50000",
                       "data.loader_workers=1", f"data.cache_dir={tmp_path / cache}", "train.max_steps=4",
                       "train.checkpoint_every=2", "train.eval_every=2", "train.report_every=1",
                       "train.eval_blocks=8")
        hooks = LocalHooks(device=torch.device("cpu"), run_dir=RunPaths.of(cfg).local)
        run_loop(cfg, hooks=hooks)
        return hooks

    straight = loop("a")
    run_dir = tmp_path / "streamed"
    kept = tmp_path / "straight_4"
    shutil.move(run_dir / "checkpoint_00000004", kept)  # the run goes back to its checkpoint of step 2
    resumed = loop("b")
    adapter = "adapter/adapter_model.safetensors"
    a, b = load_file(kept / adapter), load_file(run_dir / "checkpoint_00000004" / adapter)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loss = {r["step"]: r["train/data_bpt"] for r in straight.reports}
    assert [(r["step"], r["train/data_bpt"]) for r in resumed.reports] == [(s, loss[s]) for s in (3, 4)]
    kept_meta, meta = (json.loads((d / "meta.json").read_text()) for d in (kept, run_dir / "checkpoint_00000004"))
    assert kept_meta["tokens_per_epoch"] == meta["tokens_per_epoch"]
    # the checkpoint says how its data was read: a resume across a change of data.streaming can say so
    assert meta["data_streamed"] is True and meta["data_plan"] == kept_meta["data_plan"] != ""

def _pieces_text(data, i: int) -> str:
    return "".join(data.train.shards.files[f].read_bytes()[a:b].decode() for f, a, b in data.train.shards.pieces[i])


def test_quotas_follow_each_shards_words_so_a_whitespace_heavy_stretch_is_not_oversampled(tok, plays, tmp_path,
                                                                                          capfd):
    """A stretch whose paragraphs are parted by 200 whitespace lines (bytes with no token): each train shard's quota
    is within [0.8, 1.25] of its blocks, and tokenising a shard says the ratio. By bytes, the stretch's shards got
    ~4x their blocks an epoch."""
    paras = [p for p in re.split(r"\n\s*\n", plays) if p.strip()]
    third = len(paras) // 3
    padded = "\n\n".join(paras[:third]) + "\n\n" + "\n \n".join(
        p + "\n" + " \n" * 200 for p in paras[third:2 * third]) + "\n\n" + "\n\n".join(paras[2 * third:]) + "\n"
    src = tmp_path / "padded.txt"
    src.write_text(padded)
    data = streamed(tok, src, tmp_path / "c")
    s = data.train
    ratios = {int(i): s.quota[i] / len(s.shards.open(int(i))) for i in s.train}
    assert all(0.8 <= r <= 1.25 for r in ratios.values()), ratios
    padded_shards = [i for i in ratios if _pieces_text(data, i).count(" \n") > 1000]
    assert len(padded_shards) >= 3  # the stretch is shards of its own, not one lost among the plays'
    out = capfd.readouterr()
    assert re.search(r"shard \d+ \(\d+ bytes from .*padded.txt byte \d+\): \d+ blocks, quota \d+ an epoch "
                     r"\(x[01]\.\d\d\)", out.out)
    assert "warning" not in out.err


def test_a_shard_without_a_block_hands_its_positions_to_the_next_shard_and_too_small_shards_are_refused(tok, source,
                                                                                                      tmp_path, capfd):
    """A jsonl whose middle 30 KB are lines with a blank text field: their shards give no block, and the stream gives
    those positions to the next shard of the visit order that has blocks (a warning, no error), the same on every
    call. A shard size that gives the smallest shard fewer than 2 blocks is refused when the stream is opened,
    naming data.shard_bytes and data.block_size."""
    words = [f"word{i % 997} said {i}" for i in range(6000)]
    lines = ([json.dumps({"text": " ".join(words[i:i + 12])}) for i in range(0, 3000, 12)]
             + [json.dumps({"text": ""})] * 2500 + [json.dumps({"text": " ".join(words[i:i + 12])})
                                                    for i in range(3000, 6000, 12)])
    src = tmp_path / "blanks.jsonl"
    src.write_text("\n".join(lines) + "\n")
    data = streamed(tok, src, tmp_path / "a", kind="jsonl", shard_bytes=8192)
    s = data.train
    empty = [int(i) for i in s.train if len(s.shards.open(int(i))) == 0]
    assert len(empty) >= 2 and all(s.quota[i] > 0 for i in empty)
    assert "holds 0 tokens, too few for one block" in capfd.readouterr().err
    rows = s.rows(0, 2 * len(s))  # two epochs, every position
    real = {bytes(r) for i in s.train for r in np.asarray(s.shards.open(int(i)))}
    assert len(rows) == 2 * len(s) and all(bytes(r) in real for r in rows)  # every position a train shard's block
    again = streamed(tok, src, tmp_path / "b", kind="jsonl", shard_bytes=8192)
    np.testing.assert_array_equal(again.train.rows(0, 2 * len(s)), rows)
    # a position of an empty shard's visit is the next non-empty shard's block past that shard's own quota
    for p in range(len(s)):
        epoch, visit, shard, offset = s.locate(p)
        if shard in empty:
            order = s._order(epoch)[0]
            nxt = next(int(j) for j in order[visit + 1:] if int(j) not in empty)
            blocks, perm = s._blocks(epoch, nxt)
            skipped = sum(int(s.quota[int(j)]) for j in order[visit + 1:list(order).index(nxt) + 1])
            np.testing.assert_array_equal(rows[p], blocks[perm[(offset + skipped) % len(blocks)]])
            break
    else:
        pytest.fail("no position fell in an empty shard's visit")
    with pytest.raises(DataError, match=r"smallest shard .* fewer than 2: raise data.shard_bytes \(now 4096\) or "
                                        r"lower data.block_size"):
        prepare_data(tok, source="text", path=str(source), block_size=1024, cache_dir=str(tmp_path / "d"),
                     streaming="on", shard_bytes=4096, loader_workers=0)


def test_the_shard_cache_is_keyed_by_the_stream_layout_and_word_definition_and_refuses_another_plan(tok, source,
                                                                                                      tmp_path,
                                                                                                      monkeypatch):
    from raytrain_scu.core.data import cache as cache_mod

    data = streamed(tok, source, tmp_path)
    meta_path = Path(data.cache_path) / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["layout"] == stream_mod.STREAM_LAYOUT and len(meta["pieces"]) == len(data.train.shards.pieces)
    assert meta["words"][0] > 1000
    assert meta["words_version"] == stream_mod.WORDS_VERSION
    monkeypatch.setattr(cache_mod, "STREAM_LAYOUT", stream_mod.STREAM_LAYOUT + 1)
    assert streamed(tok, source, tmp_path).cache_path != data.cache_path  # a new layout: new shard files
    monkeypatch.undo()
    monkeypatch.setattr(cache_mod, "WORDS_VERSION", stream_mod.WORDS_VERSION + 1)
    assert streamed(tok, source, tmp_path).cache_path != data.cache_path  # words counted another way: new files
    monkeypatch.undo()
    meta["words_version"] -= 1  # words counted another way, under the same key
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"counted its shards' words another way than this run \\(words_version "
                                        f"{stream_mod.WORDS_VERSION - 1} in its meta.json, "
                                        f"{stream_mod.WORDS_VERSION} here\\): delete the directory"):
        streamed(tok, source, tmp_path)
    meta["words_version"] += 1
    meta["pieces"][1][0][2] += 1  # a plan cut elsewhere, under the same key
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match="was cut by another shard plan than this run's .*delete the directory"):
        streamed(tok, source, tmp_path)


def test_a_text_without_line_ends_is_cut_at_whitespace_and_never_read_whole(tmp_path, monkeypatch):
    from raytrain_scu.core.data import scan

    t = tmp_path / "one_line.txt"
    t.write_text(" ".join(f"w{i}é" for i in range(100_000)))  # ~700 KB, no line end
    shards = plan_shards([t], kind="text", shard_bytes=65_536)
    raw = t.read_bytes()
    assert len(shards) == len(raw) // 65_536
    assert all(raw[end - 1:end] == b" " for ((_, _, end),) in shards[:-1])  # after a space: no word, no é cut
    # past a shard's nominal end a long line without a blank one after it: the cut is at a line end, not in the line
    m = tmp_path / "mixed.txt"
    m.write_bytes(b"short line\n" * 8000 + b"x" * 40_000 + b" \xc3\xa9" * 20_000 + b"\nend\n")
    cuts = [end for ((_, _, end),) in plan_shards([m], kind="text", shard_bytes=65_536)]
    assert all(m.read_bytes()[:end].endswith(b"\n") for end in cuts)
    monkeypatch.setattr(scan, "SCAN_CHUNK_BYTES", 4096)
    monkeypatch.setattr(scan, "MAX_JSONL_LINE_BYTES", 65_536)
    chunks = list(scan._chunks(t, whole_lines=False))
    assert max(len(c) for _, c in chunks) <= 2 * 4096 and b"".join(c for _, c in chunks) == raw
    scan.scan_text([t])
    j = tmp_path / "one_line.jsonl"
    j.write_text(json.dumps({"text": raw.decode()}))
    with pytest.raises(DataError, match=re.escape(f"{j}:1: no line end in 65536 bytes from byte offset 0")):
        scan.scan_jsonl([j], "text")
    good = b'{"text": "fine"}\n' * 300  # ~5 KB: the long line begins in the second chunk, after 300 good lines
    j.write_bytes(good + json.dumps({"text": raw.decode()}).encode())
    with pytest.raises(DataError, match=re.escape(f"{j}:301: no line end in 65536 bytes from byte offset "
                                                  f"{len(good)}")):
        scan.scan_jsonl([j], "text")


def test_the_scans_decode_strictly_and_name_the_files_line_and_offset(tmp_path, monkeypatch):
    """An encoded surrogate (bytes ED A0 80, which json.loads of bytes lets pass and a worker's decode refuses) and a
    bad byte in a later chunk: each named by the file's line and byte offset."""
    from raytrain_scu.core.data import scan

    monkeypatch.setattr(scan, "SCAN_CHUNK_BYTES", 256)
    good = [json.dumps({"text": f"doc {i}"}).encode() for i in range(100)]
    lines = list(good)
    lines[70] = b'{"text": "a \xed\xa0\x80 b"}'
    f = tmp_path / "s.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    offset = len(b"\n".join(good[:70])) + 1 + len(b'{"text": "a ')
    with pytest.raises(DataError, match=re.escape(f"{f}:71: not UTF-8 text: undecodable byte 0xed at byte offset "
                                                  f"{offset}")):
        scan_jsonl([f], "text")
    t = tmp_path / "t.txt"
    t.write_bytes(b"fine text\n" * 300 + b"bad \xff here\n")
    with pytest.raises(DataError, match=re.escape(f"{t}:301: not UTF-8 text: undecodable byte 0xff at byte offset "
                                                  f"3004")):
        scan_text([t])


def test_a_loader_threads_error_surfaces_at_the_step_that_reaches_its_shard_and_close_stops_the_threads(tok, plays,
                                                                                                        tmp_path):
    """A bad byte in one train shard, read by a loader thread ahead of the stream: every step before that shard's
    first position gives its blocks, the one that reaches it raises the thread's DataError (naming the file's line
    and byte offset); close() stops the threads."""
    src = tmp_path / "bad.txt"
    src.write_text(plays)
    probe = streamed(tok, src, tmp_path / "probe")
    s = probe.train
    bad_shard = int(s._order(0)[0][3])  # the 4th shard visited: the loader thread reaches it ahead of the stream
    first = next(p for p in range(len(s)) if s.locate(p)[2] == bad_shard)
    (_, start, end), = s.shards.pieces[bad_shard]
    raw = bytearray(src.read_bytes())
    at = raw.index(b"e", (start + end) // 2)
    raw[at] = 0xFF  # same size: the same plan
    src.write_bytes(bytes(raw))
    line = raw[:at].count(b"\n") + 1
    data = streamed(tok, src, tmp_path / "c", loader_workers=1)
    try:
        s = data.train
        assert s.quota.tolist() == probe.train.quota.tolist()
        for position in range(0, first - first % 8, 8):
            s.rows(position, 8)
        with pytest.raises(DataError, match=re.escape(f"{src}:{line}: not UTF-8 text: undecodable byte 0xff at byte "
                                                      f"offset {at}")):
            s.rows(first - first % 8, 8)
        assert s._pool is not None
    finally:
        data.close()
    assert s._pool is None and not s._pending
    deadline = time.monotonic() + 10
    while any(t.name.startswith("raytrain_scu-shards") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a loader thread outlived close()"
        time.sleep(0.05)
    probe.close()


def test_close_returns_at_once_while_a_shard_is_being_tokenised_and_the_build_is_abandoned(tok, plays, tmp_path):
    """close() while a loader thread builds a ~2 MB shard (~0.6 s of tokenising here): close returns at once, the
    daemon thread ends within a batch of documents, and neither the shard's file nor a temp file is left (a build
    that ran on, as a ThreadPoolExecutor's would, leaves the file); a later stream builds the shard whole."""
    src = tmp_path / "big.txt"
    src.write_text(plays * 10)  # ~4 MB: the validation shard and one train shard of ~2 MB
    data = streamed(tok, src, tmp_path / "c", loader_workers=1, shard_bytes=2 << 20)
    s = data.train
    shard = int(s._order(0)[0][0])
    lock = Path(f"{s.shards.path(shard)}.lock")
    s.prefetch(0)
    deadline = time.monotonic() + 30
    while not lock.exists():  # the loader thread holds the shard's file lock: its build has begun
        assert time.monotonic() < deadline, "the loader thread never began the shard"
        time.sleep(0.002)
    threads = list(s._pool.threads)
    assert all(t.daemon for t in threads)  # the process's exit does not wait for them
    t0 = time.monotonic()
    data.close()
    assert time.monotonic() - t0 < 0.05
    for t in threads:
        t.join(5)
        assert not t.is_alive(), "a loader thread outlived close() by 5 s"
    assert not s.shards.path(shard).exists(), "the build finished: close() did not stop it"
    assert not list(Path(data.cache_path).glob(".shard_*"))  # no temp file: the rename never came
    again = streamed(tok, src, tmp_path / "c", loader_workers=0, shard_bytes=2 << 20)
    assert len(again.train.rows(0, 4)) == 4 and again.train.shards.path(shard).exists()


def test_a_resume_across_a_change_of_data_streaming_or_of_the_shard_plan_says_which():
    from raytrain_scu.core.checkpoint import check_tokens_per_epoch, data_facts
    from raytrain_scu.errors import CheckpointError

    whole = {"tokens_per_epoch": 1000, "step": 4, **data_facts(streamed=False, plan="")}
    with pytest.raises(CheckpointError, match=r"the checkpoint's source was read whole and is now read in shards "
                                              r"\(data.streaming"):
        check_tokens_per_epoch(whole, measured=990, override=0, streamed=True, plan="abc")
    shards = {"tokens_per_epoch": 1000, "step": 4, **data_facts(streamed=True, plan="abc")}
    with pytest.raises(CheckpointError, match=r"read in shards and is now read whole \(data.streaming"):
        check_tokens_per_epoch(shards, measured=990, override=0, streamed=False, plan="")
    with pytest.raises(CheckpointError, match=r"the source's shard plan changed \(data.shard_bytes"):
        check_tokens_per_epoch(shards, measured=990, override=0, streamed=True, plan="def")


def test_preflight_gives_the_n_the_run_uses_and_its_source_and_names_shard_bytes_for_a_short_streamed_split(
        source, tmp_path, capsys):
    """Preflight on a streamed source: the N it returns is controller.tokens_per_epoch's where set ("config"), else
    the estimate ("estimated"), which the console line words accordingly; a global batch beyond the train split
    names data.shard_bytes, not data.val_fraction (which plays no part)."""
    from raytrain_scu.driver import run as run_mod
    from raytrain_scu.driver.preflight import preflight
    from raytrain_scu.errors import PreflightError

    base = ("scaling.num_workers=1", "tracking.enabled=false", "data.source=text", f"data.path={source}",
            "data.max_documents=0", "data.streaming=on", "data.shard_bytes=50000", f"data.cache_dir={tmp_path / 'c'}")
    facts = preflight(tiny_cfg(tmp_path, "n", *base))
    assert facts["tokens_per_epoch_from"] == "estimated" and facts["tokens_per_epoch"] > 0
    set_n = preflight(tiny_cfg(tmp_path, "n", *base, "controller.tokens_per_epoch=12345"))
    assert (set_n["tokens_per_epoch"], set_n["tokens_per_epoch_from"]) == (12345, "config")
    assert "set by controller.tokens_per_epoch" in run_mod.N_FROM["config"]
    assert "estimated" in run_mod.N_FROM["estimated"] and "estimated" not in run_mod.N_FROM["config"]
    with pytest.raises(PreflightError, match=r"fewer than one global batch .* or lower data.shard_bytes \(the "
                                             r"validation split is one shard"):
        preflight(tiny_cfg(tmp_path, "n", *base, "data.batch_size=100000"))


# ---------------------------------------------------------------- 1 GB: a run's start, a malformed line

@pytest.fixture(scope="module")
def big(tmp_path_factory, plays):
    """A ~1 GB text source and a ~1 GB jsonl (a document a line) with a malformed line 3 lines before its end, written
    in 64 MiB pieces (a few seconds), deleted after the module: {"text": path, "jsonl": path, "bad_line": n}."""
    root = tmp_path_factory.mktemp("gb")
    paras = [p for p in re.split(r"\n\s*\n", plays) if p.strip()]
    text = root / "big.txt"
    piece = (plays.rstrip("\n") + "\n\n").encode()
    _write_repeated(text, piece, GB)
    jsonl = root / "big.jsonl"
    piece = "".join(json.dumps({"text": p}) + "\n" for p in paras).encode()
    n = _write_repeated(jsonl, piece, GB) * len(paras)
    with open(jsonl, "ab") as f:
        f.write(b'{"text": "fine"}\n{"text": "a quote left open}\n{"text": "fine"}\n{"text": "fine"}\n')
    yield {"text": text, "jsonl": jsonl, "bad_line": n + 2}
    text.unlink()
    jsonl.unlink()


def _write_repeated(path: Path, piece: bytes, size: int) -> int:
    """``piece`` repeated to at least ``size`` bytes; returns the repeats."""
    times = -(-size // len(piece))
    per_write = max(1, 64 * 2**20 // len(piece))
    with open(path, "wb") as f:
        for done in range(0, times, per_write):
            f.write(piece * min(per_write, times - done))
    return times


class PeakRSS:
    """This process's resident memory, sampled every 20 ms in a thread: the peak over a block, above its start."""

    def __enter__(self):
        self.start = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _rss() -> int:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    @property
    def grown_mib(self) -> float:
        return (self.peak - self.start) / 2**20


@pytest.mark.slow
def test_a_2_worker_run_on_a_1gb_text_source_starts_its_first_step_within_the_bound_in_bounded_driver_memory(
        big, ray_local, tmp_path, capsys):
    """In-process driver (this process), the tests' Ray: preflight (a UTF-8 scan of the 1 GB, the validation shard
    tokenised), 2 CPU workers with 2 loader threads each, the first steps. Neither the driver nor a worker tokenises
    the source whole: the shard files on disk at the end are the few the run read."""
    from raytrain_scu.driver.run import run

    cfg = tiny_cfg(tmp_path, "gb", "data.source=text", f"data.path={big['text']}", "data.max_documents=0",
                   "data.loader_workers=2", "data.shard_bytes=1048576", f"data.cache_dir={tmp_path / 'tokens'}",
                   "train.max_steps=2", "train.report_every=1", "train.checkpoint_every=2", "train.eval_every=2")
    assert cfg.data.streaming == "auto"  # 1 GB is above STREAM_ABOVE_BYTES
    t0 = time.time()
    with PeakRSS() as rss:
        summary = run(cfg, quiet=True)
    client, runs = mlflow_runs(tmp_path, "gb")
    first = min(m.timestamp for m in client.get_metric_history(runs[0].info.run_id, "train/data_bpt")) / 1000 - t0
    out = capsys.readouterr().out
    n_shards = -(-big["text"].stat().st_size // 2**20)
    built = list((tmp_path / "tokens").glob("*/shard_*.bin"))
    params = runs[0].data.params
    print(f"LOAD_1GB first_step_s={first:.1f} total_s={time.time() - t0:.1f} driver_rss_grown_mib={rss.grown_mib:.0f} "
          f"shards_built={len(built)}/{n_shards} tokens_per_epoch={params['derived.tokens_per_epoch']}")
    assert summary["steps"] == 2
    assert first < FIRST_STEP_BOUND_S, first
    assert rss.grown_mib < DRIVER_RSS_BOUND_MIB, rss.grown_mib
    assert 2 <= len(built) <= 12 < n_shards  # the validation shard and those the stream reached or read ahead
    assert params["derived.tokens_per_epoch_from"] == "estimated" and params["data.streaming"] == "auto"
    estimate = int(params["derived.tokens_per_epoch"])
    assert abs(estimate / (big["text"].stat().st_size * 0.368) - 1) < 0.05  # ~0.37 tokens a byte, less shards' tails
    assert f"tokens_per_epoch={estimate} (estimated: the train shards' words x the validation shard's tokens" in out


@pytest.mark.slow
def test_a_malformed_line_near_the_end_of_a_1gb_jsonl_is_refused_naming_it_before_ray_starts(big, tmp_path,
                                                                                            monkeypatch, capsys):
    """The CLI's main in this process with Ray's start made a failure: the error comes from preflight's scan of every
    line, within the bound, and names the file and the line."""
    import raytrain_scu.train as train
    from raytrain_scu.ray import launch

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was about to start: the malformed line was not caught before")

    monkeypatch.setattr(launch, "init_ray", refuse)
    monkeypatch.setattr(launch.ray, "is_initialized", lambda: False)
    t0 = time.time()
    with PeakRSS() as rss:
        code = train.main([TINY, "data.source=jsonl", f"data.path={big['jsonl']}", "data.max_documents=0",
                           "data.loader_workers=2", f"data.cache_dir={tmp_path / 'tokens'}",
                           f"run.storage_path={tmp_path}"])
    took = time.time() - t0
    err = capsys.readouterr().err
    print(f"LOAD_1GB_JSONL refused_s={took:.1f} driver_rss_grown_mib={rss.grown_mib:.0f} line={big['bad_line']}")
    assert code == 2, err
    # the error is the only line on stderr (scaling.strategy=auto says its choice only where there is a GPU)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {big['jsonl']}:{big['bad_line']}: not a JSON object"), err
    assert took < FIRST_STEP_BOUND_S and rss.grown_mib < DRIVER_RSS_BOUND_MIB
    assert not (tmp_path / "tokens").exists()  # refused before a single shard was tokenised
