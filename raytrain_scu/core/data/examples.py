"""Supervised fine-tuning examples: conversations and prompt/completion pairs -> token ids with a target mask.

    records = iter_records(source, path, fmt)               # (where, dict): "file.jsonl:12" or "dataset row 7"
    ex = to_example(record, fmt, where)                     # validated: a message list or a (prompt, completion)
    ids, target = render(tokenizer, ex, template=..., train_on="answers")

A conversation is rendered with the tokenizer's chat template (or ``data.chat_template``); with
``train_on=answers`` its target tokens are the assistant turns as the template writes them (content and end-of-turn
token), found as the characters each assistant turn adds to the rendered text. A prompt/completion pair is the prompt's
ids (with the tokenizer's special tokens) then the completion's and EOS; the completion and EOS are the targets.
Every problem is a DataError naming the line or row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from raytrain_scu.errors import DataError

FORMATS = ("text", "chat", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Example:
    """One validated example: ``messages`` (chat) or ``prompt`` and ``completion`` (prompt_completion)."""
    where: str
    messages: tuple = ()
    prompt: str = ""
    completion: str = ""


def detect_format(record: dict, text_field: str) -> str:
    """The format of a record by its fields: ``text_field`` -> text (what a text config has always read),
    ``messages`` -> chat, ``prompt`` and ``completion`` -> prompt_completion, else text."""
    if text_field in record:
        return "text"
    if "messages" in record:
        return "chat"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    return "text"


def jsonl_records(file: Path, lines: Iterable[str], first_line: int = 1) -> Iterator[tuple[str, dict]]:
    """(``file:line``, object) for each non-blank line of a jsonl file; ``lines`` start at line ``first_line``."""
    for lineno, line in enumerate(lines, start=first_line):
        if not line.strip():
            continue
        where = f"{file}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object")
        yield where, obj


def _text(value, where: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: {what} is {type(value).__name__}, not a string")
    if not value.strip():
        raise DataError(f"{where}: {what} is empty")
    return value


def to_example(record: dict, fmt: str, where: str) -> Example:
    """The record as an :class:`Example`, checked: a list of messages with known roles and non-empty string content,
    or a non-empty prompt and completion."""
    if fmt == "chat":
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: message {i} is not an object with 'role' and 'content'")
            if m["role"] not in ROLES:
                raise DataError(f"{where}: message {i} has role {m['role']!r}, expected one of {', '.join(ROLES)}")
            out.append({"role": m["role"], "content": _text(m["content"], where, f"message {i}'s content")})
        return Example(where=where, messages=tuple(out))
    if fmt == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in record:
                raise DataError(f"{where}: no field {key!r} (prompt_completion data has 'prompt' and 'completion')")
        return Example(where=where, prompt=_text(record["prompt"], where, "'prompt'"),
                       completion=_text(record["completion"], where, "'completion'"))
    raise ValueError(f"not an example format: {fmt!r}")


def read_template(value: str) -> str:
    """``data.chat_template``: a Jinja file's text, or the value itself when it is an inline Jinja template."""
    if not value:
        return ""
    if "{{" in value or "{%" in value:  # a template, never a path (a long one is no valid file name)
        return value
    p = Path(value).expanduser()
    if p.is_file():
        return p.read_text()
    raise DataError(f"data.chat_template={value!r}: no such file, and not an inline Jinja template "
                    f"(one has {{% ... %}} or {{{{ ... }}}})")


def chat_template(tokenizer, override: str) -> str:
    """The template conversations are rendered with: ``override`` (from :func:`read_template`), else the
    tokenizer's own; refuses a tokenizer without one."""
    if override:
        return override
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: set data.chat_template to a "
                        f"Jinja file or an inline template")
    return own


def _apply(tokenizer, messages, template: str, generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 - the template's own refusals (jinja2 errors, raise_exception)
        raise DataError(f"{where}: the chat template refused this conversation: {type(e).__name__}: "
                        f"{str(e)[:300]}") from None


def answer_spans(tokenizer, ex: Example, template: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns: turn i's span is what rendering
    messages[:i+1] adds to rendering messages[:i] with the generation prompt. Refuses a template under which those
    renderings are not prefixes of the whole (one that rewrites earlier turns)."""
    full = _apply(tokenizer, ex.messages, template, False, ex.where)
    spans = []
    for i, m in enumerate(ex.messages):
        if m["role"] != "assistant":
            continue
        before = _apply(tokenizer, ex.messages[:i], template, True, ex.where) if i else ""
        upto = _apply(tokenizer, ex.messages[:i + 1], template, False, ex.where)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise DataError(f"{ex.where}: the chat template renders earlier turns differently once later ones follow "
                            f"(message {i}): the answer tokens cannot be located; use data.train_on=all or a "
                            f"data.chat_template without that behaviour")
        spans.append((len(before), len(upto)))
    return full, spans


def render(tokenizer, ex: Example, *, template: str, train_on: str) -> tuple[list[int], list[bool]]:
    """(token ids, target per token) of one example."""
    if ex.messages:
        full, spans = answer_spans(tokenizer, ex, template)
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = list(enc["input_ids"])
        if train_on == "all":
            return ids, [True] * len(ids)
        target = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
        return ids, target
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError(f"tokenizer {tokenizer.name_or_path!r} has no eos token: a completion cannot end")
    prompt = list(tokenizer(ex.prompt, add_special_tokens=True, verbose=False)["input_ids"])
    completion = list(tokenizer(ex.completion, add_special_tokens=False, verbose=False)["input_ids"]) + [eos]
    return prompt + completion, [train_on == "all"] * len(prompt) + [True] * len(completion)


def fit(ids: list[int], target: list[bool], *, block_size: int, too_long: str, where: str
        ) -> Optional[tuple[list[int], list[bool]]]:
    """The example cut to ``block_size + 1`` tokens (``block_size`` predictions) where ``too_long=truncate``; refused
    where ``refuse``. None when truncation leaves no target token to predict (the caller counts it)."""
    if len(ids) > block_size + 1:
        if too_long == "refuse":
            raise DataError(f"{where}: {len(ids)} tokens, more than data.block_size + 1 = {block_size + 1} "
                            f"(raise data.block_size or set data.too_long=truncate)")
        ids, target = ids[:block_size + 1], target[:block_size + 1]
        if not any(target[1:]):
            return None
    return ids, target
