"""The supervised fine-tuning bench's examples: prompt and answer lengths drawn from a public SFT dataset, filled with
text the random-init models can learn from, the same examples for every part.

The lengths are LIMA's (GAIR/lima, Zhou et al. 2023: 1,029 curated conversations, 29 of them multi-turn), measured
once with SmolLM2-135M-Instruct's tokenizer and kept in ``data/lima_lengths.json`` beside this module with where they
came from (:func:`measure_lima`: the history turns, then the instruction and input, are the prompt; the output is the
answer). Tokens: mean 651, median 451, 10th percentile 141, 90th 1,544, longest 3,625; 51 of 1,029 are longer than
2,048. :func:`draw` samples (prompt, answer) pairs from them with replacement, seeded; :func:`write_examples` fills
each pair with consecutive stretches of the Shakespeare token stream, prompt then answer, so that the bench's models
(the presets, with the Shakespeare BPE) learn and their loss falls. Our loop reads the file as ``prompt_completion``
data; the peers get the same examples tokenised by the same code (:func:`token_examples`)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from raytrain_scu.core.data.examples import fit, render, to_example

LENGTHS = Path(__file__).parent / "data" / "lima_lengths.json"


def measure_lima(lima_json: str, tokenizer) -> list[list[int]]:
    """[prompt tokens, answer tokens] of each record of a LIMA file in the instruction/input/output/history layout
    (LLaMA-Factory's ``data/lima.json``), without special tokens: how ``data/lima_lengths.json`` was made."""
    pairs = []
    for r in json.loads(Path(lima_json).read_text()):
        turns = [t for q, a in r.get("history") or [] for t in (q, a)]
        prompt = "\n\n".join(turns + [r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")])
        pairs.append([len(tokenizer(prompt, add_special_tokens=False)["input_ids"]),
                      len(tokenizer(r["output"], add_special_tokens=False)["input_ids"])])
    return pairs


def draw(n: int, seed: int, scale: float = 1.0) -> list[tuple[int, int]]:
    """``n`` (prompt, answer) token lengths drawn from LIMA's with replacement, each times ``scale`` (at least 1 token:
    ``--smoke`` shrinks them with its block)."""
    pairs = json.loads(LENGTHS.read_text())["pairs"]
    return [(max(1, round(p * scale)), max(1, round(a * scale))) for p, a in random.Random(seed).choices(pairs, k=n)]


def write_examples(path: Path, tokenizer, stream: np.ndarray, lengths: list[tuple[int, int]]) -> Path:
    """A jsonl file of ``{"prompt", "completion"}`` records, one per length pair: the prompt is the next
    ``prompt`` tokens of ``stream`` (token ids of the tokenizer) decoded, the completion the ``answer`` tokens after
    them. Re-encoding decoded text gives back about as many tokens (BPE merges at the cuts may differ by one or two)."""
    pos, lines = 0, []

    def text(n: int) -> str:  # the next n tokens as text, and up to 64 more, one at a time, while it is only blank
        nonlocal pos
        if n + 64 > len(stream):
            raise ValueError(f"a token stream of {len(stream)} tokens is too short for an example of {n}")
        if pos + n + 64 > len(stream):
            pos = 0
        out, most = tokenizer.decode(stream[pos:pos + n].tolist()), n + 64
        while not out.strip() and n < most:
            n += 1
            out = tokenizer.decode(stream[pos:pos + n].tolist())
        if not out.strip():
            raise ValueError(f"tokens {pos}..{pos + n} of the stream decode to blank text")
        pos += n
        return out

    for p, a in lengths:
        prompt = text(p)
        lines.append(json.dumps({"prompt": prompt, "completion": text(a)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def token_examples(path: Path, tokenizer, block: int) -> list[tuple[list[int], list[bool]]]:
    """(token ids, target per token) of every record of ``path``, rendered and cut to ``block + 1`` tokens as our
    loop's data path does (``data.train_on=answers``, ``data.too_long=truncate``)."""
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        ex = to_example(json.loads(line), "prompt_completion", f"{path}:{i + 1}")
        ids, target = render(tokenizer, ex, template="", train_on="answers")
        kept = fit(ids, target, block_size=block, too_long="truncate", where=ex.where)
        if kept is not None:
            out.append(kept)
    return out


def stats(examples: list[tuple[list[int], list[bool]]]) -> dict:
    """Lengths and target share of the examples, for the record."""
    lengths = np.array([len(ids) for ids, _ in examples])
    targets = sum(sum(t[1:]) for _, t in examples)
    return {"examples": len(examples), "mean_tokens": round(float(lengths.mean()), 1),
            "median_tokens": float(np.median(lengths)), "max_tokens": int(lengths.max()),
            "target_share": round(targets / float(lengths.sum()), 4)}
