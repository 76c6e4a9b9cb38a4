"""``model.offload_activations``: the activations autograd keeps from the forward to the backward held in pinned host
memory instead of on the GPU. No ray, mlflow or torch.distributed.

Under gradient checkpointing what a step keeps per decoder layer is the layer's input (tokens x hidden: 32 MiB at the
8B shape, 2 x 2048 tokens, so 1 GiB over 32 layers); everything else is recomputed in the backward. The hooks here
(``torch.autograd.graph.saved_tensors_hooks``, entered around the decoder's forward) copy each such tensor to pinned
host memory on a side stream as it is saved, so its GPU memory is free as soon as the copy is done, and copy it back
when the backward needs it. The backward meets the layers in reverse, so when one layer's input is fetched the one
below it is fetched ahead on the side stream, behind the recompute that runs meanwhile: the step waits for at most the
first fetch. Parameters (and views of them), tensors under :data:`MIN_BYTES`, and tensors whose layout is not dense
stay where they are; so do tensors on a device this module does not offload from.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

MIN_BYTES = 1 << 20  # smaller saved tensors stay on the device: their copies would cost more in launches than they save


@dataclass
class _Held:
    """One saved tensor moved to the host: the copy, the event its copy-out finishes at, and (once fetched ahead)
    the device copy with the event its copy-in finishes at."""
    host: torch.Tensor
    device: torch.device
    copied_out: Optional[torch.cuda.Event]
    index: int
    used: bool = False  # handed to the backward once: never fetched ahead again
    fetched: Optional[torch.Tensor] = None
    copied_in: Optional[torch.cuda.Event] = None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span without gaps or overlaps, in some order of its dimensions (a
    copy into an empty tensor of the same strides then holds exactly it)."""
    if t.is_contiguous():
        return True
    span = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:
            continue
        if t.stride(d) != span:
            return False
        span *= t.size(d)
    return True


class ActivationOffload:
    """Saved-tensor hooks for one model's training forward: ``with offload.hooks(): forward`` (a new forward drops the
    last one's host copies). ``devices``: the device types whose tensors move (``cuda``; the CPU tests add ``cpu``,
    where a copy on the host stands in for the host copy, with no streams). ``moved`` / ``moved_bytes``: what the last
    forward moved; ``left_unused``: how many of them the last backward never asked for."""

    def __init__(self, model: nn.Module, devices: tuple[str, ...] = ("cuda",), min_bytes: int = MIN_BYTES):
        self.devices = devices
        self.min_bytes = min_bytes
        # the storages of every parameter and buffer: a tensor saved as a view of one stays where it is
        self._frozen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._held: list[_Held] = []
        self._streams: dict = {}  # a side stream per device
        self.moved = 0
        self.moved_bytes = 0
        self.left_unused = 0  # moved tensors the last backward never asked for (released at its end)
        self._release_queued = False

    @contextlib.contextmanager
    def hooks(self):
        self._held = []
        self._release_queued = False
        self.moved = self.moved_bytes = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _movable(self, t: torch.Tensor) -> bool:
        return (t.device.type in self.devices and not isinstance(t, nn.Parameter)
                and t.numel() * t.element_size() >= self.min_bytes
                and _dense(t)
                and t.untyped_storage().data_ptr() not in self._frozen)

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, t: torch.Tensor):
        if not self._movable(t):
            return t
        cuda = t.device.type == "cuda"
        host = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu", pin_memory=cuda)
        event = None
        if cuda:
            side = self._side_stream(t.device)
            side.wait_stream(torch.cuda.current_stream(t.device))  # t is written by then
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            t.record_stream(side)  # its memory is not reused before the copy has read it
        else:
            host.copy_(t)
        self.moved += 1
        self.moved_bytes += t.numel() * t.element_size()
        self._held.append(_Held(host, t.device, event, len(self._held)))
        return self._held[-1]

    def _fetch(self, held: _Held) -> None:
        """Start the copy back of ``held``: on CUDA on the side stream, after its copy out."""
        if held.device.type != "cuda":
            held.fetched = held.host.to(held.device, copy=True)
            return
        side = self._side_stream(held.device)
        with torch.cuda.stream(side):
            side.wait_event(held.copied_out)
            held.fetched = held.host.to(held.device, non_blocking=True)
            held.copied_in = torch.cuda.Event()
            held.copied_in.record(side)

    def _unpack(self, held):
        if not isinstance(held, _Held):
            return held
        if not self._release_queued and torch._C._current_graph_task_id() != -1:
            # the first tensor this backward asks for: at its end, drop any tensor fetched ahead and never asked for
            # (a backward that stops early) and this object's list of the host copies (the graph keeps its own
            # references to them while it lives)
            torch.autograd.Variable._execution_engine.queue_callback(self._release)
            self._release_queued = True
        if held.fetched is None:
            self._fetch(held)
        out, held.fetched, held.used = held.fetched, None, True  # a second unpack (a retained graph) fetches again
        if held.device.type == "cuda":
            current = torch.cuda.current_stream(held.device)
            current.wait_event(held.copied_in)
            out.record_stream(current)  # allocated on the side stream, used and freed on this one
        ahead = next((h for h in reversed(self._held[:held.index]) if not h.used and h.fetched is None), None)
        if ahead is not None:
            self._fetch(ahead)  # the backward needs the tensor saved before this one next
        return out

    def _release(self) -> None:
        self.left_unused = sum(not h.used for h in self._held)
        for h in self._held:
            h.fetched = None
        self._held = []
        self._release_queued = False
