"""evaluate.py: per-document BPT on the tiny model checked by hand, the paired bootstrap on synthetic data with a
known difference, adapters, --max-tokens, the progress and estimate lines, and the CLI: as a user runs it, on Ray
workers (the same numbers as one process) with only the package's lines on the console."""
import io
import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT, TINY, user_env

from raytrain_scu.cli.evaluate import main
from raytrain_scu.config.load import load_config
from raytrain_scu.core.data.blocks import document_ids
from raytrain_scu.core.data.cache import prepare_data
from raytrain_scu.core.loss import CausalLMLoss
from raytrain_scu.core.model.build import apply_lora, build_model
from raytrain_scu.core.model.source import load_tokenizer
from raytrain_scu.driver.evaluate import cap_tokens, evaluate, paired_bootstrap, score_documents
from raytrain_scu.errors import EvalError

LN2 = math.log(2.0)
WORDS = "the king queen sword crown night day love death war peace and of my lord thou art".split()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A .jsonl of 12 short documents (20-120 words): quick to score, several windows each at block 32."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(12):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS, rng.integers(20, 120)))}) + "\n")
    return str(path)


def cfg_for(corpus, *overrides):
    return load_config(TINY, ["data.source=jsonl", f"data.path={corpus}", "data.max_documents=0",
                              "data.block_size=32", "data.batch_size=4", "data.val_fraction=0.5", *overrides])


def save_adapter(tok, path, *, b_std, seed=0, **model_kw):
    """A LoRA adapter on the tiny model (built as evaluate builds it); b_std > 0 makes it change the outputs."""
    if model_kw:
        from transformers import AutoModelForCausalLM

        from raytrain_scu.core.model.presets import preset_config

        cfg = preset_config("tiny", len(tok))
        for k, v in model_kw.items():
            setattr(cfg, k, v)
        base = AutoModelForCausalLM.from_config(cfg)
    else:
        base = build_model("tiny", vocab_size=len(tok), seed=seed)
    model = apply_lora(base, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name and b_std > 0:
            torch.nn.init.normal_(p, std=b_std)
    model.save_pretrained(str(path))
    return str(path)


# ---------------------------------------------------------------- scoring by hand

@pytest.mark.parametrize("fused", [True, False])
def test_bpt_matches_hand_computation(tok, fused):
    docs = ["To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
            "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds"]
    model = build_model("tiny", vocab_size=len(tok), seed=3)
    token_docs = document_ids(tok, docs)
    block = 8
    assert all(len(ids) > 2 * block for ids in token_docs)  # several windows per document, a short last one
    nats, tokens = score_documents(CausalLMLoss(model, fused=fused, chunk_size=5), token_docs, block_size=block,
                                   batch_size=3)

    hand_nats = []
    for doc in docs:
        ids = tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        total = 0.0
        for start in range(0, len(ids) - 1, block):
            x = torch.tensor([ids[start:start + block]])
            y = torch.tensor(ids[start + 1:start + block + 1])
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=x).logits[0, :len(y)].float(), dim=-1)
            total -= logp[torch.arange(len(y)), y].double().sum().item()
        hand_nats.append(total)
        assert tokens[len(hand_nats) - 1] == len(ids) - 1  # every token but the first is a target once
    bpt, hand_bpt = nats.sum() / tokens.sum() / LN2, sum(hand_nats) / tokens.sum() / LN2
    assert 5 < bpt < 20  # a random-init model over a 2048 vocabulary: about log2(2048) = 11 bits
    assert bpt == pytest.approx(hand_bpt, abs=1e-6)
    assert nats == pytest.approx(hand_nats, rel=1e-6)


# ---------------------------------------------------------------- paired bootstrap

def synthetic(n_docs, delta_bpt, seed):
    """Per-document nats of two models whose population BPT, token-weighted, differs by exactly delta_bpt.

    Documents are short (50 tokens) or long (500) and differ a lot in difficulty, shared by A and B (pairing
    removes it). A is 0.1 bit/token worse on short documents and better on long ones by what makes the
    token-weighted difference delta_bpt; an average of per-document BPTs would be far off (0.056 for 0.02).
    Plus zero-mean per-document noise.
    """
    rng = np.random.default_rng(seed)
    tokens = rng.choice([50.0, 500.0], n_docs)
    nats_b = tokens * rng.uniform(1.0, 4.0, n_docs)
    bits_a_minus_b = np.where(tokens == 50.0, 0.1, (550.0 * delta_bpt - 50.0 * 0.1) / 500.0)
    nats_a = nats_b + tokens * bits_a_minus_b * LN2 + rng.normal(0.0, 0.02, n_docs) * tokens
    return nats_a, nats_b, tokens


def test_bootstrap_ci_contains_true_difference():
    a, b, t = synthetic(200, 0.02, seed=1)
    r = paired_bootstrap(a, b, t, n_boot=2000, ci=0.95, seed=0)
    assert r["ci_low"] < 0.02 < r["ci_high"]
    assert r["ci_low"] > 0 and r["p_sign_flip"] < 0.01   # and the difference is detected
    assert r["diff_bpt"] == pytest.approx((a.sum() - b.sum()) / t.sum() / LN2)
    assert r["ci_low"] < r["mean_diff_bpt"] < r["ci_high"]
    assert paired_bootstrap(a, b, t, n_boot=2000, ci=0.95, seed=0) == r  # seeded


def test_bootstrap_zero_difference_ci_contains_zero():
    a, b, t = synthetic(200, 0.0, seed=2)
    r = paired_bootstrap(a, b, t, n_boot=2000, ci=0.95, seed=0)
    assert r["ci_low"] < 0.0 < r["ci_high"] and r["p_sign_flip"] > 0.025
    same = paired_bootstrap(b, b, t, n_boot=100, seed=0)
    assert same["ci_low"] == same["ci_high"] == 0.0 and same["p_sign_flip"] == 1.0


def test_bootstrap_coverage_is_near_nominal():
    hits = 0
    for seed in range(200):
        a, b, t = synthetic(60, 0.01, seed=100 + seed)
        r = paired_bootstrap(a, b, t, n_boot=400, ci=0.9, seed=seed)
        hits += r["ci_low"] <= 0.01 <= r["ci_high"]
    assert 0.82 <= hits / 200 <= 0.97


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0, 2.0], [3, 4])
    with pytest.raises(ValueError):
        paired_bootstrap([1.0], [1.0], [0])


# ---------------------------------------------------------------- adapters

def test_adapter_changes_bpt_and_switching_is_exact(tok, corpus, tmp_path):
    cfg = cfg_for(corpus)
    trained = save_adapter(tok, tmp_path / "trained", b_std=0.2)
    zero = save_adapter(tok, tmp_path / "zero", b_std=0.0)  # LoRA B = 0: exactly the base model
    r = evaluate(cfg, adapter=trained, compare_base=True, n_boot=200)
    a, b = r["models"]["A"], r["models"]["B"]
    assert a["adapter"] == trained and b["adapter"] is None
    # the targets counted apart from scoring: every held-out document's tokens + EOS, less its first token
    meta = prepare_data(tok, streaming="off", loader_workers=0,
                        source="jsonl", path=corpus, block_size=32, val_fraction=0.5, seed=0,
                        cache_dir=str(tmp_path / "cache")).meta
    assert r["documents"] == meta["n_val_docs"] == 6
    assert a["tokens"] == b["tokens"] == meta["n_val_tokens"] - meta["n_val_docs"]
    assert abs(a["bpt"] - b["bpt"]) > 1e-3
    assert r["comparison"]["diff_bpt"] == pytest.approx(a["bpt"] - b["bpt"], abs=1e-9)
    swapped = evaluate(cfg, adapter=zero, compare_adapter=trained, n_boot=200)
    assert swapped["models"]["A"]["bpt"] == b["bpt"]
    assert swapped["models"]["B"]["bpt"] == a["bpt"]


@pytest.mark.filterwarnings("ignore:Found missing adapter keys")  # peft's only complaint about "shallower"
def test_adapter_for_another_base_is_a_clear_error(tok, corpus, tmp_path):
    cfg = cfg_for(corpus)
    narrow = save_adapter(tok, tmp_path / "narrow", b_std=0.1, hidden_size=32, intermediate_size=64)
    with pytest.raises(EvalError, match="does not fit this base model"):
        evaluate(cfg, adapter=narrow)
    deeper = save_adapter(tok, tmp_path / "deeper", b_std=0.1, num_hidden_layers=3)  # same shapes, extra layer
    with pytest.raises(EvalError, match="6 of its 18 weights have no place in the model"):
        evaluate(cfg, adapter=deeper)
    shallower = save_adapter(tok, tmp_path / "shallower", b_std=0.1, num_hidden_layers=1)  # peft only warns
    with pytest.raises(EvalError, match="6 weights the model expects are not in it"):
        evaluate(cfg, adapter=shallower)
    with pytest.raises(EvalError, match="adapter directory not found"):
        evaluate(cfg, adapter=str(tmp_path / "missing"))


def test_a_preset_is_drawn_as_the_adapters_run_drew_it(tok, corpus, tmp_path, capsys):
    """A run's adapter on a random-init preset is scored on the base its run drew (output/base_model.json: seed,
    dtype, device), found beside a finished run's adapter and for its checkpoints; runs that drew it differently are
    not compared, and a base drawn on CUDA is not redrawn on a CPU."""
    import shutil

    from raytrain_scu.driver.evaluate import base_model, run_recipe

    run = tmp_path / "run"
    adapter = save_adapter(tok, run / "output" / "adapter", b_std=0.2, seed=7)
    shutil.copytree(adapter, run / "checkpoint_00000010" / "adapter")
    loose = shutil.copytree(adapter, tmp_path / "loose")  # no recipe: drawn here, from the config's seed
    recipe = {"model.name": "tiny", "model.gguf_file": "", "seed": 7, "vocab_size": len(tok), "dtype": "bfloat16",
              "init_device": "cpu"}
    (run / "output" / "base_model.json").write_text(json.dumps(recipe))
    cfg = cfg_for(corpus)
    checkpoint = str(run / "checkpoint_00000010" / "adapter")  # a checkpoint: its run's output/ holds the recipe
    assert run_recipe(cfg, {"A": adapter}) == recipe == run_recipe(cfg, {"A": checkpoint})
    assert run_recipe(cfg, {"A": adapter, "B": str(loose)}) == recipe and run_recipe(cfg, {"A": str(loose)}) == {}
    assert run_recipe(cfg_for(corpus, "model.name=tiny-llama-3.1-8b"), {"A": adapter}) == {}  # another model's
    base = base_model(cfg, vocab_size=len(tok), device=torch.device("cpu"), dtype=torch.float32, recipe=recipe)
    drawn = build_model("tiny", vocab_size=len(tok), dtype=torch.bfloat16, seed=7).state_dict()
    assert all(torch.equal(v, drawn[k].float()) for k, v in base.state_dict().items())
    # the recipe reaches the scoring: not the base the config's seed 0 draws here
    got = evaluate(cfg, adapter=adapter, split="all", n_boot=10)["models"]["A"]["bpt"]
    assert "loading tiny as its run drew it (seed 7, bfloat16, on cpu)" in capsys.readouterr().out
    assert got != evaluate(cfg, adapter=str(loose), split="all", n_boot=10)["models"]["A"]["bpt"]
    assert "warning: no base_model.json says how the tiny preset of" in capsys.readouterr().out  # said, not silent
    run_recipe(cfg, {"A": adapter, "B": str(loose)})
    assert "scored on the other adapter's recipe" in capsys.readouterr().out
    (tmp_path / "bad" / "output" / "adapter").mkdir(parents=True)
    (tmp_path / "bad" / "output" / "base_model.json").write_text("{not json")
    with pytest.raises(EvalError, match="base_model.json: cannot read how the run drew its base"):
        run_recipe(cfg, {"A": str(tmp_path / "bad" / "output" / "adapter")})
    other = tmp_path / "other"
    shutil.copytree(run / "output", other / "output")
    (other / "output" / "base_model.json").write_text(json.dumps({**recipe, "init_device": "cuda"}))
    with pytest.raises(EvalError, match="drew the tiny preset differently"):
        evaluate(cfg, adapter=adapter, compare_adapter=str(other / "output" / "adapter"))
    if not torch.cuda.is_available():
        with pytest.raises(EvalError, match="was drawn on a GPU .* evaluate them on a machine with a CUDA GPU"):
            evaluate(cfg, adapter=str(other / "output" / "adapter"))


def test_many_adapters_share_one_slot_and_score_as_each_alone(tok, corpus, tmp_path):
    """Adapters of one config are scored through one peft adapter whose weights are replaced: each scores exactly as
    when it is the only adapter, in any order, and one made for another base is still refused by name."""
    from dataclasses import asdict

    from raytrain_scu.driver.adapters import AdapterSlots
    from raytrain_scu.driver.evaluate import score_shard

    config = asdict(cfg_for(corpus))
    docs = ["To be, or not to be, that is the question.", "Friends, Romans, countrymen, lend me your ears."]
    paths = {f"b{i}": save_adapter(tok, tmp_path / f"b{i}", b_std=0.1 * (i + 1)) for i in range(3)}
    many = score_shard(config, {"base": "", "b0": paths["b0"], "b1": paths["b1"], "again": paths["b0"],
                                "b2": paths["b2"]}, docs)
    for label, path in [("b0", paths["b0"]), ("b1", paths["b1"]), ("b2", paths["b2"])]:
        alone = score_shard(config, {label: path}, docs)
        assert many["nats"][label].tolist() == alone["nats"][label].tolist()
    assert many["nats"]["again"].tolist() == many["nats"]["b0"].tolist()
    assert len({tuple(v.tolist()) for v in many["nats"].values()}) == 4  # base and three different adapters
    slots = AdapterSlots(build_model("tiny", vocab_size=len(tok)), list(paths.values()))
    assert list(slots.model.peft_config) == ["slot0"]  # three adapters of one config: one peft adapter
    wider = save_adapter(tok, tmp_path / "wider", b_std=0.1)
    cfg = json.loads((tmp_path / "wider" / "adapter_config.json").read_text())
    (tmp_path / "wider" / "adapter_config.json").write_text(json.dumps({**cfg, "lora_dropout": 0.1}))
    assert list(AdapterSlots(build_model("tiny", vocab_size=len(tok)), [paths["b0"], wider]).model.peft_config) == [
        "slot0", "slot1"]  # another config: a slot of its own
    deeper = save_adapter(tok, tmp_path / "deeper", b_std=0.1, num_hidden_layers=3)  # same adapter config
    with pytest.raises(EvalError, match=f"adapter {deeper} does not fit.*6 of its 18 weights have no place"):
        score_shard(config, {"b0": paths["b0"], "deeper": deeper}, docs)


# ---------------------------------------------------------------- how much, how it goes

def test_max_tokens_takes_the_same_share_of_every_document():
    docs = [list(range(101)), list(range(31)), list(range(11))]  # 100, 30 and 10 targets
    assert cap_tokens(docs, 0) == docs and cap_tokens(docs, 140) == docs  # 0: all; enough: all
    capped = cap_tokens(docs, 60)  # 25 + 25 + 10: the short one whole, the others their first 25 targets
    assert [len(d) - 1 for d in capped] == [25, 25, 10] and capped[0] == docs[0][:26]
    assert sum(len(d) - 1 for d in cap_tokens(docs, 61)) <= 61
    with pytest.raises(EvalError, match="less than one token for each of the 3 documents"):
        cap_tokens(docs, 2)


def test_progress_estimate_and_how_it_ran(tok, corpus, tmp_path, capsys):
    from raytrain_scu.console import Counter

    cfg = cfg_for(corpus)
    adapter = save_adapter(tok, tmp_path / "a", b_std=0.2)
    out = io.StringIO()
    counter = Counter(2 * 300, desc="evaluate", stream=out, tty=False, every_s=0.0, estimate=True, settle_s=0.0)
    r = evaluate(cfg, adapter=adapter, compare_base=True, n_boot=100, max_tokens=300, progress=counter)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith("[raytrain_scu] warning: no base_model.json says how the tiny preset")  # a loose adapter
    first = said[1]  # before anything loads: what, how much, where
    assert first == (f"[raytrain_scu] evaluate: 2 model(s) x {r['tokens']} tokens (--max-tokens 300 of "
                     f"{r['ran']['tokens_available']:,}) of 6 documents, in this process on the CPU "
                     f"({torch.get_num_threads()} threads); loading tiny")
    assert 0 < r["tokens"] <= 300 and r["ran"]["where"].startswith("this process") and r["ran"]["workers"] == 0
    lines = out.getvalue().splitlines()
    assert re.fullmatch(r"\[raytrain_scu\] evaluate: estimate \d:\d\d:\d\d for 600 tokens at [\d,]+ tokens/s "
                        r"\(measured over the first 0 s\)", lines[0]), lines
    counts = [int(m.group(1).replace(",", "")) for m in
              (re.fullmatch(r"\[raytrain_scu\] evaluate: ([\d,]+)/600 tokens  [\d,]+ tokens/s  ETA \S+", x)
               for x in lines[1:-1]) if m]
    assert len(counts) == len(lines) - 2 and counts == sorted(counts) and counts[-1] < 600, lines  # one per batch
    assert re.fullmatch(r"\[raytrain_scu\] evaluate: \d+/600 tokens in \d:\d\d:\d\d, [\d,]+ tokens/s", lines[-1])
    assert lines[-1].startswith(f"[raytrain_scu] evaluate: {2 * r['tokens']}/600")


def test_the_table_shows_each_adapter_path_whole_in_one_aligned_column():
    from raytrain_scu.cli.evaluate import format_table

    long = "/home/someone/raytrain_scu_runs/smollm2-shakespeare-own-text/output/adapter_best"
    model = {"bpt": 5.385, "tokens": 12000, "documents": 40}
    result = {"model": "tiny", "path": "", "source": "shakespeare", "split": "val", "val_fraction": 0.25, "seed": 0,
              "documents": 40, "tokens": 12000, "block_size": 64, "comparison": None,
              "models": {"A": {**model, "adapter": long}, "B": {**model, "adapter": None}}}
    lines = format_table(result).splitlines()
    assert lines[2].split()[:2] == ["A", long] and lines[3].split()[:2] == ["B", "(base)"]
    ends = {lines[1].index("BPT") + len("BPT")} | {line.index("5.3850") + len("5.3850") for line in lines[2:4]}
    assert len(ends) == 1, lines  # the BPT column right-aligned under its header


# ---------------------------------------------------------------- CLI

@pytest.mark.slow
def test_cli_on_ray_workers_prints_only_its_lines_and_matches_one_process(tok, corpus, tmp_path):
    """As a user runs it (Ray's token authentication at its default), on 2 Ray workers: the line before loading,
    Ray's start, the last progress line, the table and how it ran; nothing foreign on either stream; the JSON is the
    held-out split of --config, and every document scores as in one process."""
    adapter = save_adapter(tok, tmp_path / "a", b_std=0.2)
    out = tmp_path / "eval.json"
    args = ["--config", TINY, "--set", "data.source=jsonl", "--set", f"data.path={corpus}", "--set",
            "data.max_documents=0", "--block-size", "32", "--val-fraction", "0.25", "--adapter", adapter,
            "--compare-base", "--bootstrap", "200"]
    r = subprocess.run([sys.executable, "-m", "raytrain_scu.evaluate", *args, "--workers", "2", "--per-document",
                        "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=user_env(tmp_path / "home"),
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    print(r.stdout)  # for the record (-s)
    assert r.stderr == "" and "\r" not in r.stdout, r.stderr[-3000:]
    ours = re.compile(r"^(\[raytrain_scu\] |  |held-out BPT of )")
    assert [line for line in r.stdout.splitlines() if not ours.match(line)] == [], r.stdout
    lines = r.stdout.splitlines()
    result = json.loads(out.read_text())
    tokens = result["tokens"]
    assert lines[0].startswith("[raytrain_scu] warning: no base_model.json says how the tiny preset")  # loose
    assert lines[1] == (f"[raytrain_scu] evaluate: 2 model(s) x {tokens:,} tokens of 3 documents, in 2 Ray task(s); "
                        f"loading tiny")
    assert lines[2].startswith("[raytrain_scu] starting a local Ray instance (token authentication on")
    assert re.search(rf"^\[raytrain_scu\] evaluate: {2 * tokens:,}/{2 * tokens:,} tokens in ", r.stdout, re.M)
    assert "A − B" in r.stdout and "(base)" in r.stdout
    assert re.search(rf"^  scored in 2 Ray task\(s\): 2 x {tokens:,} tokens in \d+ s", r.stdout, re.M), r.stdout
    # --config: exactly the documents training held out (its seed, the fraction given here), as prepare_data split them
    meta = prepare_data(tok, streaming="off", loader_workers=0,
                        source="jsonl", path=corpus, block_size=32, val_fraction=0.25, seed=0,
                        cache_dir=str(tmp_path / "cache")).meta
    assert result["documents"] == meta["n_val_docs"] == 3 and result["split"] == "val" and result["block_size"] == 32
    assert result["models"]["A"]["tokens"] == meta["n_val_tokens"] - meta["n_val_docs"]
    c = result["comparison"]
    assert c["n_boot"] == 200 and c["ci_low"] <= c["mean_diff_bpt"] <= c["ci_high"]
    assert result["ran"]["workers"] == 2
    single = evaluate(cfg_for(corpus, "data.val_fraction=0.25"), adapter=adapter, compare_base=True, n_boot=200)
    assert result["per_document"]["tokens"] == single["per_document"]["tokens"]
    for label in ("A", "B"):
        assert result["per_document"]["nats"][label] == pytest.approx(single["per_document"]["nats"][label], rel=1e-6)
        assert result["models"][label]["bpt"] == pytest.approx(single["models"][label]["bpt"], rel=1e-6)
    for key in ("ci_low", "ci_high", "diff_bpt"):
        assert c[key] == pytest.approx(single["comparison"][key], abs=1e-6)


def test_cli_in_this_process_writes_the_json_without_per_document_scores_unless_asked(tok, corpus, tmp_path, capsys):
    adapter = save_adapter(tok, tmp_path / "a", b_std=0.2)
    out = tmp_path / "eval.json"
    assert main(["--model", "tiny", "--source", "jsonl", "--path", corpus, "--block-size", "32", "--adapter", adapter,
                 "--bootstrap", "50", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "held-out BPT of tiny on jsonl" in text and "  scored in this process on the CPU" in text
    result = json.loads(out.read_text())
    assert "per_document" not in result and result["comparison"] is None and result["ran"]["workers"] == 0


def test_cli_errors_exit_2(corpus, tmp_path, capsys):
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": "  "}) + "\n" + json.dumps({"text": "\n"}) + "\n")
    cases = [(["--model", "tiny", "--source", "jsonl", "--path", corpus, "--adapter", str(tmp_path / "nope")],
              "adapter directory not found"),
             (["--model", "tiny", "--source", "jsonl", "--path", str(blank), "--split", "all"], "no text"),
             (["--model", "tiny", "--source", "jsonl", "--path", corpus, "--compare-base"], "give --adapter"),
             (["--model", "tiny", "--source", "jsonl", "--path", corpus, "--precision", "fp8"], "model.precision"),
             (["--source", "jsonl", "--path", corpus], "give --model")]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err, (argv, err)
