"""Built-in random-init model presets (``model.name``): ``tiny`` for tests, the Llama-3.2-1B, Llama-3.1-8B,
Llama-3.1-70B and Granite-4.0-H-1B shapes for benchmarks, most with a shrunken ``tiny-`` twin for CPU tests. They are
tokenized with a BPE trained on the bundled Shakespeare texts."""
from __future__ import annotations

from transformers import AutoConfig

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
    # the Llama-3.1-70B shape, random init, for the fsdp config (experiments/llama-3.1-70b-fsdp.yaml): ~131 GiB of
    # weights in bf16, more than one card; untied head, RoPE theta without 3.1's long-context scaling
    "llama-3.1-70b-shape": llama_preset(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256,
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


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, vocab_size: int):
    """The transformers config of a preset (a Llama unless the preset names another ``model_type``)."""
    kw = dict(PRESETS[name])
    kw.setdefault("vocab_size", vocab_size)
    return AutoConfig.for_model(kw.pop("model_type", "llama"), **kw)
