"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the loss module, and what a sharded adapter needs beside it: the
gradient clip over sharded gradients, the whole adapter gathered for export, and the sharded training state saved and
loaded with ``torch.distributed.checkpoint`` (DCP), which reshards to any world size.

One FSDP unit per decoder layer and one at the root (the loss module: embeddings, final norm, LM head), so a layer's
frozen base and its LoRA factors are gathered whole for its forward and backward only; the adapters' gradients are
reduce-scattered (their mean over the ranks) and AdamW's moments live beside each rank's shard.

The model is sharded while it is still on the meta device (no weight memory on any rank); each rank then
materialises its own shards and rank 0's values of the whole model, read on its host, are broadcast into them tensor
by tensor (:func:`shard`, :class:`FullModel`). So only rank 0's host ever holds the whole model, and no device does."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from raytrain_scu.core.dist import all_gather_object, broadcast_object, is_dist, world_size
from raytrain_scu.core.model.parts import decoder_layers
from raytrain_scu.errors import CheckpointError, ModelError

# the trainable tensors alone: the frozen base is rebuilt from the model's source at a resume, never saved
ADAPTER_ONLY = {"ignore_frozen_params": True}


def _trainable(model: torch.nn.Module, state: dict) -> dict:
    """``state`` (a model state dict of ``model``) without its frozen tensors. ``ignore_frozen_params`` alone keeps a
    frozen head tied to the embeddings: ``named_parameters`` lists the tied pair once, under the embeddings' name, so
    the head's key is never matched to a frozen parameter."""
    names = {n.replace("_orig_mod.", "") for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def _unwrapped(error: BaseException) -> BaseException:
    """The first rank's own failure inside DCP's ``CheckpointException`` (a BaseException that wraps each rank's
    error with its traceback), so that an OSError (a full disk) stays one; any other error as it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException) and error.failures:
        first, _trace = next(iter(error.failures.values()))
        return first
    return error


def mixed_precision(dtype: torch.dtype):
    """The ``MixedPrecisionPolicy`` of ``model.precision``'s compute dtype: fp32 leaves every tensor as it is stored;
    bf16/fp16 gather the parameters (the float32 LoRA factors too) in that dtype and reduce gradients in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


class FullModel(NamedTuple):
    """Rank 0's whole model on its host, what every rank's shards are filled with: its state dict and its
    non-persistent buffers (RoPE's ``inv_freq``), which a state dict leaves out and ``to_empty`` leaves
    uninitialised."""

    state: dict
    buffers: dict

    @classmethod
    def of(cls, model: torch.nn.Module) -> "FullModel":
        state = model.state_dict()
        return cls(state=state, buffers={n: b for n, b in model.named_buffers() if n not in state})


def shard(loss_model: torch.nn.Module, peft_model: torch.nn.Module, *, device: torch.device, dtype: torch.dtype,
          full: Optional[FullModel]) -> torch.nn.Module:
    """All ranks: ``fully_shard`` on every decoder layer of ``peft_model``, then on ``loss_model`` (the root, which
    holds the rest), over all the ranks of the process group; then each rank's shards materialised on ``device``
    and filled with ``full``, rank 0's (None on the others: :func:`fill_from_rank0`). In place, returns
    ``loss_model``. ``peft_model`` may be on the meta device (it is meant to be): no rank then ever holds the whole
    model on its device. The parameters become DTensors: read them again afterwards (``regularizer.adapter_params``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not is_dist():
        raise ModelError("scaling.strategy=fsdp shards the model over a torch.distributed process group, and this "
                         "worker has none (Ray Train's workers have one); set scaling.strategy=ddp")
    layers = decoder_layers(peft_model)
    if not layers:
        raise ModelError(f"scaling.strategy=fsdp puts one FSDP unit on each decoder layer, and "
                         f"{type(peft_model.get_base_model()).__name__} has no decoder `layers` list; set "
                         f"scaling.strategy=ddp")
    mesh = init_device_mesh(device.type, (world_size(),))
    policy = mixed_precision(dtype)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root = getattr(loss_model, "_orig_mod", loss_model)  # model.compile_scope=model: the module under the compile
    fully_shard(root, mesh=mesh, mp_policy=policy)
    root.to_empty(device=device)  # the root: its FSDP state re-points every unit's shards at the new memory
    fill_from_rank0(peft_model, full)
    return loss_model


def fill_from_rank0(model: torch.nn.Module, full: Optional[FullModel]) -> None:
    """All ranks: rank 0's ``full`` model into every rank's shards of ``model`` (a peft model sharded by
    :func:`shard`, materialised), one tensor at a time: ``set_model_state_dict`` with ``broadcast_from_rank0`` sends
    each whole tensor from rank 0 and each rank keeps its shard of it. Then the non-persistent buffers, small,
    as one object. A key either side lacks, or a tensor whose shapes differ, is an error naming it. Rank 0's
    ``full`` is emptied, freeing its host copy."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = full.state if full is not None else {}
    _check_shapes(model, state if full is not None else None)
    # not strict: a module held twice (quant.embedding_int8's table, shared by the embedding and the tied head) is
    # filled once, under its first name, and its second name is reported missing; such aliases alone may be missing
    missing, unexpected = set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))
    # every rank's keys, so that all ranks raise together rather than one waiting in the next collective
    gaps = [gap for gap in all_gather_object((sorted(set(missing) - _aliases(model)), sorted(unexpected))) if any(gap)]
    if gaps:
        raise ModelError(f"scaling.strategy=fsdp: rank 0's model does not fill the shards: missing {gaps[0][0]}, "
                         f"unexpected {gaps[0][1]}; set scaling.strategy=ddp")
    persistent = set(model.state_dict())
    buffers = {n: b for n, b in model.named_buffers() if n not in persistent}
    values = broadcast_object(full.buffers if full is not None else None)
    if set(values) != set(buffers):
        raise ModelError(f"scaling.strategy=fsdp: the sharded model's non-persistent buffers {sorted(buffers)} are "
                         f"not rank 0's model's {sorted(values)}; set scaling.strategy=ddp")
    with torch.no_grad():
        for name, buffer in buffers.items():
            buffer.copy_(values[name])
    if full is not None:
        full.state.clear()
        full.buffers.clear()


def _check_shapes(model: torch.nn.Module, state: Optional[dict]) -> None:
    """All ranks: rank 0's tensors (``state``, None on the others) against the whole shapes of ``model``'s shards,
    before any tensor is sent: a model the two sides built otherwise (a layer bitsandbytes left unquantised that the
    meta build made 4-bit, another block size) fails on every rank at once, naming the tensor."""
    theirs = broadcast_object(_shapes(state) if state is not None else None)
    mine = _shapes(model.state_dict())
    differ = sorted(k for k in theirs.keys() & mine.keys() if theirs[k] != mine[k])
    if differ:
        more = f" ({len(differ)} tensors differ)" if len(differ) > 1 else ""
        raise ModelError(f"scaling.strategy=fsdp: rank 0's {differ[0]} is {list(theirs[differ[0]])} and the shards' "
                         f"{list(mine[differ[0]])}{more}: the model built on the meta device is not rank 0's; set "
                         f"scaling.strategy=ddp")


def _shapes(state: dict) -> dict:
    """Each entry's whole shape (a DTensor's is the whole tensor's); () for a value without one."""
    return {k: tuple(getattr(v, "shape", ())) for k, v in state.items()}


def _aliases(model: torch.nn.Module) -> set[str]:
    """The state dict keys of ``model`` that name a tensor an earlier key names too (a shared module's)."""
    seen, aliases = set(), set()
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in seen:
            aliases.add(key)
        seen.add(id(value))
    return aliases


def _is_dtensor(t) -> bool:
    """Whether ``t`` is a DTensor, without importing torch.distributed.tensor here: where no code has imported it, no
    tensor can be one. (A process that imports core.checkpoint alone, the driver's checks, skips its ~0.4 s; a worker
    imports it anyway, through worker.loop's torch._dynamo.)"""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(t, tensor.DTensor)


def is_sharded(params) -> bool:
    """Whether the tensors are FSDP shards (DTensors)."""
    return any(_is_dtensor(p) for p in params)


def local(t):
    """A DTensor's shard on this rank (differentiable), any other tensor (or None) as it is."""
    return t.to_local() if _is_dtensor(t) else t


def clip_gradients(params: list, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` that also takes FSDP's sharded gradients: the total norm over every rank's
    shards (a plain 0-d tensor on every rank), then each gradient scaled by the same factor."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if _is_dtensor(total):  # a norm of the shards: the reduction over the ranks happens here
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def full_adapter_state(model: torch.nn.Module) -> dict:
    """All ranks: every LoRA factor of the sharded peft ``model`` gathered whole into CPU memory on rank 0 (the
    others get an empty dict), keyed as ``model.state_dict()`` keys them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 **ADAPTER_ONLY))
    return _trainable(model, state)


class GatheredAdapter:
    """A sharded peft model's adapter gathered on rank 0 (all ranks build it), saved by ``save_pretrained`` as the
    model would save it: one ordinary peft adapter."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.state = model, full_adapter_state(model)

    def save_pretrained(self, path: str, **kwargs) -> None:
        self.model.save_pretrained(path, state_dict=self.state, **kwargs)


def save_sharded(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """All ranks: the LoRA factors and AdamW's state with DCP into ``path``, each rank writing its own shards
    (``__<rank>_0.distcp``) and rank 0 the index (``.metadata``). Each rank may write into a directory of its own:
    the files are put together afterwards (Ray Train's checkpoint upload)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from torch.distributed.checkpoint.api import CheckpointException

    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(**ADAPTER_ONLY))
    state = {"model": _trainable(model, model_state), "optim": optim_state}
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)))
    except CheckpointException as e:  # a rank's OSError (a full disk) raised as itself, for DiskFullError
        first = _unwrapped(e)
        if first is e:
            raise
        raise first from e


def load_sharded(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """All ranks: the LoRA factors and AdamW's state from a DCP directory of :func:`save_sharded`, resharded to this
    run's ranks (any world size, sharded or whole tensors)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    # not strict: the model's own load_state_dict would miss the frozen base's keys, which are not saved; dcp.load
    # is strict already, raising where the checkpoint lacks any LoRA factor or moment asked for
    options = StateDictOptions(**ADAPTER_ONLY, strict=False)
    from torch.distributed.checkpoint.api import CheckpointException

    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": _trainable(model, model_state), "optim": optim_state}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)))
    except CheckpointException as e:
        first = _unwrapped(e)
        raise CheckpointError(f"{path.parent.name}: its sharded state does not load: "
                              f"{type(first).__name__}: {first}") from first
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=options)
