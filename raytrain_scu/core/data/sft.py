"""Examples -> rows: read and check every record, split by example, render with the target mask, fit to the block,
pack (:mod:`.packing`). What :func:`~raytrain_scu.core.data.cache.prepare_data` builds for chat and
prompt_completion data."""
from __future__ import annotations

from raytrain_scu.core.data.blocks import split_documents
from raytrain_scu.core.data.examples import chat_template, fit, read_template, render, to_example
from raytrain_scu.core.data.packing import IGNORE_INDEX, rows_of
from raytrain_scu.core.data.sources import describe, iter_records
from raytrain_scu.errors import DataError


def template_for(tokenizer, fmt: str, override: str) -> str:
    """The chat template a format renders with ("" for prompt_completion, which uses none)."""
    return chat_template(tokenizer, read_template(override)) if fmt == "chat" else ""


def load_examples(source: str, path: str, fmt: str, max_examples: int = 0) -> list:
    """Every record of the source as a checked :class:`~raytrain_scu.core.data.examples.Example` (the first
    ``max_examples`` > 0)."""
    out = []
    for where, record in iter_records(source, path):
        out.append(to_example(record, fmt, where))
        if 0 < max_examples <= len(out):
            break
    if not out:
        raise DataError(f"no examples in {describe(source, path)}")
    return out


def build_rows(tokenizer, *, source: str, path: str, fmt: str, template: str, train_on: str, too_long: str,
               packing: bool, max_examples: int, block_size: int, val_fraction: float, seed: int):
    """({split: rows arrays}, meta): the examples split by a seeded permutation, rendered, fitted and laid into
    rows. Meta counts the examples of each split, those truncated and those left out (no target left after
    truncation), the target tokens and how full the rows are."""
    examples = load_examples(source, path, fmt, max_examples)
    train, val = split_documents(examples, val_fraction=val_fraction, seed=seed)
    eos = tokenizer.eos_token_id
    arrays, meta = {}, {}
    for split, split_examples in (("train", train), ("val", val)):
        fitted, truncated, dropped = [], 0, 0
        for ex in split_examples:
            ids, target = render(tokenizer, ex, template=template, train_on=train_on)
            if not any(target[1:]):
                raise DataError(f"{ex.where}: no target token (nothing to learn: "
                                + ("no assistant turn)" if ex.messages else "an empty completion)"))
            truncated += len(ids) > block_size + 1
            kept = fit(ids, target, block_size=block_size, too_long=too_long, where=ex.where)
            if kept is None:
                dropped += 1
                continue
            fitted.append(kept)
        if not fitted:
            raise DataError(f"{describe(source, path)}: no {split} example keeps a target token within "
                            f"data.block_size={block_size}")
        rows = rows_of(fitted, block_size=block_size, packing=packing, pad_id=eos if eos is not None else 0)
        arrays[split] = rows
        n_targets = int((rows["y"] != IGNORE_INDEX).sum())
        meta.update({f"n_{split}_examples": len(fitted), f"n_{split}_truncated": truncated,
                     f"n_{split}_dropped": dropped, f"n_{split}_targets": n_targets,
                     f"n_{split}_tokens": int(rows["length"].sum()), f"n_{split}_rows": len(rows["x"]),
                     f"{split}_fill": round(float(rows["length"].sum()) / rows["x"].size, 4)})
    return arrays, meta


def summary(meta: dict) -> str:
    """The run's first-lines account of example data: examples, truncated and left out, targets, how full rows are."""
    parts = []
    for split in ("train", "val"):
        parts.append(f"{split} {meta[f'n_{split}_examples']} examples in {meta[f'n_{split}_rows']} rows "
                     f"({100 * meta[f'{split}_fill']:.1f}% full), {meta[f'n_{split}_targets']} target tokens")
    cut = sum(meta[f"n_{s}_truncated"] for s in ("train", "val"))
    dropped = sum(meta[f"n_{s}_dropped"] for s in ("train", "val"))
    note = f"; {cut} truncated to data.block_size" if cut else ""
    note += f", {dropped} of them left out (no target token within the block)" if dropped else ""
    return "; ".join(parts) + note

