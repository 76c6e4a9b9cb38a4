"""``quant.dequant_4bit``: a 4-bit (bitsandbytes) frozen base whose weights are dequantised by torch ops instead of
bitsandbytes' kernels, so that under torch.compile inductor fuses each weight's dequantisation into one kernel inside
the layer's graph, and the product is a plain GEMM. No ray, mlflow or torch.distributed.

bitsandbytes packs two 4-bit codes per byte (the first in the high nibble), one absmax per block of ``blocksize``
weights, and with double quantisation those absmaxes in 8 bits, one float scale per 256 of them plus an offset:

    absmax[b] = code8[absmax_q[b]] * scale[b // 256] + offset         (double quantisation)
    W.flat[i] = code4[nibble i] * absmax[i // blocksize]

:class:`_Dequantised` runs ``x @ W.T`` from the packed codes and dequantises again in its backward (``grad @ W``), as
bitsandbytes' own matmul does: no bf16 copy of a weight outlives its product. The codes, absmaxes and scales are the
module's own (bitsandbytes' QuantState), referenced as buffers; nothing is requantised, so the weights are the ones
bitsandbytes would use, and the CPU test holds the two dequantisations equal. Under compile the 4-bit layer's graph
has no custom op in it, and the host launches two kernels per product instead of bitsandbytes' Python path (a
profile of the compiled 8B QLoRA step on an H200 had each of its 448 gemm_4bit calls spend 270 us of host time).

Under scaling.strategy=fsdp a 4-bit layer is a :class:`ShardedNF4Linear` instead: its codes and its float32
absmaxes (double quantisation resolved once) are frozen parameters whose bytes are viewed in the compute dtype, so
FSDP2 shards them and gathers them like any weight of that dtype (its mixed precision casts nothing that already has
the dtype), and the forward views the gathered bytes back. bitsandbytes only quantises, on rank 0 (as fsdp_qlora
sets ``bnb_4bit_quant_storage`` to the compute dtype, without bitsandbytes' classes in the sharded model).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from raytrain_scu.errors import ModelError

ABSMAX_GROUP = 256  # absmaxes per float scale under bitsandbytes' double quantisation


def dequantize(packed: torch.Tensor, code: torch.Tensor, absmax: torch.Tensor, blocksize: int, shape,
               dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in ``dtype`` from its packed 4-bit codes (uint8, two per byte, high nibble first), the
    16-entry code book and one float32 absmax per block of ``blocksize`` weights."""
    p = packed.reshape(-1)
    idx = torch.stack((p >> 4, p & 0xF), dim=-1).reshape(-1).int()  # int32: a quarter of int64's bytes eager
    w = code[idx].view(-1, blocksize) * absmax.view(-1, 1)
    return w.view(shape).to(dtype)


def nested_absmax(absmax_q: torch.Tensor, code8: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor):
    """Double quantisation's float32 absmaxes from their 8-bit codes, one ``scale`` per :data:`ABSMAX_GROUP`."""
    group = torch.arange(absmax_q.numel(), device=absmax_q.device) // ABSMAX_GROUP
    return code8[absmax_q.reshape(-1).int()] * scale[group] + offset


def _absmax(parts) -> torch.Tensor:
    return nested_absmax(*parts) if len(parts) == 4 else parts[0]


class _Dequantised(torch.autograd.Function):
    """``x @ W.T`` for a frozen 4-bit ``W``, dequantised in the forward and again in the backward. ``absmax``: the
    float32 absmaxes, or under double quantisation their 8-bit codes, code book, scales and offset."""

    @staticmethod
    def forward(ctx, x, packed, code, blocksize: int, shape, *absmax):
        ctx.save_for_backward(packed, code, *absmax)
        ctx.blocksize, ctx.shape = blocksize, shape
        return F.linear(x, dequantize(packed, code, _absmax(absmax), blocksize, shape, x.dtype))

    @staticmethod
    def backward(ctx, grad_out):
        packed, code, *absmax = ctx.saved_tensors
        w = dequantize(packed, code, _absmax(absmax), ctx.blocksize, ctx.shape, grad_out.dtype)
        return (grad_out @ w, None, None, None, None, *(None for _ in absmax))


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' Linear4bit forward, through :class:`_Dequantised`: the input cast to the compute dtype, the
    output back to the input's dtype, the bias in the compute dtype."""
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    absmax = ((self.nf4_absmax_q, self.nf4_absmax_code, self.nf4_absmax_scale, self.nf4_absmax_offset)
              if self.nf4_nested else (self.nf4_absmax,))
    out = _Dequantised.apply(x, self.weight, self.nf4_code, self.nf4_blocksize, self.nf4_shape, *absmax)
    if self.bias is not None:
        out = out + self.bias.to(out.dtype)
    return out.to(inp_dtype)


@functools.cache
def _torch_class(base: type) -> type:
    return type(f"Torch{base.__name__}", (base,), {"forward": _forward})


def unconvertible(linear: nn.Module) -> str:
    """Why ``linear`` (a bitsandbytes Linear4bit) cannot take the torch dequantisation, or ''."""
    qs = getattr(linear.weight, "quant_state", None)
    if qs is None:
        return "a 4-bit layer without a quantisation state"
    if qs.quant_type != "nf4":
        return f"in {qs.quant_type}, not nf4"
    if math.prod(qs.shape) % qs.blocksize:
        return f"a {list(qs.shape)} weight, not whole blocks of {qs.blocksize}"
    if qs.nested and (qs.state2.blocksize != ABSMAX_GROUP or qs.state2.nested):
        return "doubly quantised with other than one level of 256-absmax groups"
    if getattr(qs, "packing_format_for_cpu", False):
        return "repacked for bitsandbytes' CPU inference kernel (its codes in another layout)"
    return ""


def to_torch_dequant(linear: nn.Module) -> nn.Module:
    """``linear`` (a bitsandbytes Linear4bit, :func:`unconvertible` says it may) made to dequantise with torch ops, in
    place: its quantisation state's tensors become non-persistent buffers (the same tensors, no copies) and its class
    a subclass of its own whose forward is :func:`_forward`."""
    qs = linear.weight.quant_state
    buffers = {"nf4_code": qs.code}
    if qs.nested:
        buffers.update(nf4_absmax_q=qs.absmax, nf4_absmax_code=qs.state2.code, nf4_absmax_scale=qs.state2.absmax,
                       nf4_absmax_offset=torch.as_tensor(qs.offset, dtype=torch.float32, device=qs.absmax.device))
    else:
        buffers["nf4_absmax"] = qs.absmax.float()
    for name, t in buffers.items():
        linear.register_buffer(name, t.to(linear.weight.device), persistent=False)
    linear.nf4_nested, linear.nf4_blocksize, linear.nf4_shape = qs.nested, qs.blocksize, tuple(qs.shape)
    linear.__class__ = _torch_class(type(linear))
    return linear


def convert_4bit_to_torch_dequant(model, setting: str = "torch") -> int:
    """Every bitsandbytes Linear4bit of ``model`` made to dequantise with torch ops (:func:`to_torch_dequant`); returns
    how many. Raises ModelError naming quant.dequant_4bit (``setting``, as configured) and a layer that cannot."""
    import bitsandbytes as bnb

    n = 0
    for name, m in model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit) and not hasattr(m, "nf4_shape"):
            problem = unconvertible(m)
            if problem:
                chose = "" if setting == "torch" else " (torch under model.compile)"
                raise ModelError(f"quant.dequant_4bit={setting}{chose}: {name} is {problem}; set "
                                 f"quant.dequant_4bit=bitsandbytes")
            to_torch_dequant(m)
            n += 1
    return n


def keep_4bit_layout(model) -> None:
    """Turn off bitsandbytes' CPU inference repacking in every Linear4bit of ``model``.

    On a CPU with AVX512-BF16 (``bitsandbytes.functional.has_avx512bf16``, read once per layer at construction), the
    first forward of a Linear4bit in eval mode on an input without grad (bitsandbytes' fused CPU kernel; 0.50.1 and
    0.50.2 do it) rewrites the layer in place for inference: ``weight.data`` goes from the packed [N*K/2, 1] codes to
    an [N, K/2] tiled layout, and the QuantState's doubly quantised absmaxes become bf16 ones
    (``packing_format_for_cpu``). From then on every forward, training ones too, runs ``bitsandbytes::gemv_4bit``,
    which has no autograd kernel: the gradient through the frozen layer is silently None (a warning only), so the LoRA
    layers below it stop learning after the first evaluation. Under torch.compile the swap of ``weight.data`` inside
    the traced forward leaves the compiled layer expecting the [N, K/2] weight while it is given the [N*K/2, 1] one
    (inductor's assert_size_stride on the input). A layer kept in bitsandbytes' own layout dequantises and multiplies,
    in eval as in training."""
    import bitsandbytes as bnb

    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def torch_dequant(setting: str, quant_type: str, compiled: bool) -> bool:
    """``quant.dequant_4bit`` resolved: torch where asked, or with ``auto`` for nf4 under torch.compile (eager, its
    torch ops would each run as a kernel of their own where bitsandbytes runs one)."""
    return setting == "torch" or (setting == "auto" and compiled and quant_type == "nf4")


class ShardedNF4Linear(nn.Linear):
    """A frozen nf4 ``nn.Linear`` that FSDP2 can shard: ``weight`` holds the packed codes (two per byte, high nibble
    first, bitsandbytes' order) and ``absmax`` one float32 per block of ``blocksize`` weights, both as 1-D frozen
    parameters whose bytes are viewed in ``storage_dtype`` (the compute dtype); ``code`` is the 16-entry code book.
    An ``nn.Linear`` with its ``in_features`` / ``out_features``, so peft wraps it as it wraps any linear layer; its
    forward is :class:`_Dequantised` on the bytes viewed back."""

    def __init__(self, in_features: int, out_features: int, *, blocksize: int, storage_dtype: torch.dtype,
                 bias: bool = False, device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.blocksize = in_features, out_features, blocksize
        n, size = in_features * out_features, storage_dtype.itemsize
        problem = (f"{n} weights are not whole blocks of {blocksize}" if n % blocksize else
                   f"its {n // 2} bytes of codes are not whole {storage_dtype} elements" if (n // 2) % size else "")
        if problem:
            raise ModelError(f"scaling.strategy=fsdp with quant.load_in_4bit=true: a [{out_features}, {in_features}] "
                             f"layer cannot be sharded in 4 bits ({problem}); set scaling.strategy=ddp")
        like = dict(dtype=storage_dtype, device=device)
        self.weight = _frozen(torch.empty(n // 2 // size, **like))
        self.absmax = _frozen(torch.empty(n // blocksize * 4 // size, **like))
        self.bias = _frozen(torch.empty(out_features, **like)) if bias else None
        # the code book: a non-persistent buffer, as RoPE's inv_freq (core.fsdp fills those from rank 0)
        self.register_buffer("code", torch.empty(16, dtype=torch.float32, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As bitsandbytes' Linear4bit: the input in the compute dtype (the storage's), the output in the input's."""
        inp_dtype = x.dtype
        out = _Dequantised.apply(x.to(self.weight.dtype), self.weight.view(torch.uint8), self.code, self.blocksize,
                                 (self.out_features, self.in_features), self.absmax.view(torch.float32))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(inp_dtype)

    @classmethod
    def shell(cls, linear: nn.Linear, storage_dtype: torch.dtype, blocksize: int = 64) -> "ShardedNF4Linear":
        """The empty 4-bit layer of ``linear``'s shape, on its device (the meta device under fsdp)."""
        return cls(linear.in_features, linear.out_features, blocksize=blocksize, storage_dtype=storage_dtype,
                   bias=linear.bias is not None, device=linear.weight.device)

    @classmethod
    def of(cls, linear: nn.Module, storage_dtype: torch.dtype) -> "ShardedNF4Linear":
        """The 4-bit layer holding a bitsandbytes Linear4bit's own codes (the same memory, viewed: no copy, no
        requantisation) and absmaxes, resolved to float32 where doubly quantised. Raises ModelError where
        :func:`unconvertible` says."""
        problem = unconvertible(linear)
        if problem:
            raise ModelError(f"scaling.strategy=fsdp with quant.load_in_4bit=true dequantises with torch ops, and a "
                             f"4-bit layer is {problem}; set scaling.strategy=ddp")
        qs = linear.weight.quant_state
        absmax = (nested_absmax(qs.absmax, qs.state2.code, qs.state2.absmax,
                                torch.as_tensor(qs.offset, dtype=torch.float32)) if qs.nested else qs.absmax.float())
        out_features, in_features = qs.shape
        new = cls(in_features, out_features, blocksize=qs.blocksize, storage_dtype=storage_dtype,
                  bias=linear.bias is not None, device="meta")  # the shapes checked; the tensors are these
        new.weight = _frozen(linear.weight.data.reshape(-1).view(torch.uint8).view(storage_dtype))
        new.absmax = _frozen(absmax.reshape(-1).contiguous().view(storage_dtype))
        new.code = qs.code.to(torch.float32)
        new.bias = _frozen(linear.bias.detach().to(storage_dtype)) if linear.bias is not None else None
        return new


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _replace(model: nn.Module, make, wanted) -> None:
    """Each submodule ``m`` of ``model`` that ``wanted(m)`` picks replaced by ``make(m)``, one at a time.
    (bitsandbytes' weight refers back to its layer, so a replaced layer's small tensors go at the next garbage
    collection; the codes live on in the new layer, not copied.)"""
    names = [name for name, m in model.named_modules() if wanted(m)]
    for name in names:
        parent, _, child = name.rpartition(".")
        parent = model.get_submodule(parent)
        setattr(parent, child, make(getattr(parent, child)))


def shard_ready_4bit(model: nn.Module, storage_dtype: torch.dtype) -> None:
    """Every bitsandbytes Linear4bit of ``model`` (loaded in 4 bits) replaced by its :class:`ShardedNF4Linear`,
    before peft wraps the model."""
    import bitsandbytes as bnb

    _replace(model, lambda m: ShardedNF4Linear.of(m, storage_dtype), lambda m: isinstance(m, bnb.nn.Linear4bit))


def shard_ready_4bit_shells(model: nn.Module, storage_dtype: torch.dtype) -> None:
    """On the meta device: every ``nn.Linear`` of ``model`` but its output embeddings (the LM head, which
    bitsandbytes leaves unquantised) replaced by an empty :class:`ShardedNF4Linear` of its shape, the model that
    :func:`shard_ready_4bit` makes of the 4-bit load (bitsandbytes' 64-weight blocks). A layer that bitsandbytes
    treated otherwise (one it skipped, another block size) is named, with both shapes, before rank 0's values fill
    the shards (core.fsdp)."""
    head = model.get_output_embeddings()
    _replace(model, lambda m: ShardedNF4Linear.shell(m, storage_dtype),
             lambda m: type(m) is nn.Linear and m is not head)
