"""``model.offload_activations``: the activations autograd keeps from the forward to the backward held in pinned host
memory instead of on the GPU. No ray, mlflow or torch.distributed.

The hooks here (``torch.autograd.graph.saved_tensors_hooks``, entered around the decoder's forward) copy each saved
tensor to pinned host memory on a side stream as it is saved, so its GPU memory is free as soon as the copy is done,
and copy it back when the backward needs it. Two uses:

- **Under gradient checkpointing** what a step keeps per decoder layer is the layer's input (tokens x hidden: 32 MiB at
  the 8B shape, 2 x 2048 tokens, so 1 GiB over 32 layers); everything else is recomputed in the backward. All of them
  move (no budget).
- **Without checkpointing**, with a budget (``model.offload_activations_gib``): the first tensors saved, up to the
  budget, move, so the bottom layers' activations wait on the host; the rest stay. The peak (the backward's start)
  drops by about the budget, and the copies (each way about 19 ms per GiB on an H200, measured at 2 GiB) run beside
  the step's compute.

Every saved activation (a tensor that is not a parameter, a buffer or a view of one) has an offset: the activation
bytes saved before it in the forward. The backward meets them in about reverse
order, so when it asks for the tensor at offset ``o`` every moved tensor ending within ``ahead`` bytes below ``o`` is
fetched on the side stream, behind the compute that runs meanwhile; ``ahead`` is at least the asked tensor's size (one
layer input under checkpointing), and the budget without it, so the bottom layers start coming back while as many bytes
of layers above them are still to run backward (whose memory is free by then). A compiled layer's backward asks for its
saved tensors lowest first, so a budget smaller than one layer's activations comes back only when its layer's backward
starts, and the step waits for that copy (``waited`` counts such tensors). Parameters (and views of them), tensors
under :data:`MIN_BYTES`, and tensors whose layout is not dense stay where they are; so do tensors on a device this
module does not offload from. A tensor saved twice is moved twice.

A fetched copy is allocated on the side stream, so its memory comes from that stream's pool of the caching allocator,
not from what the backward frees on the compute stream: the allocated peak falls by about the budget, the reserved
peak may fall by less (not measured).

The contract is one forward under :meth:`ActivationOffload.hooks`, then its backward: a second forward before the
first one's backward replaces the list the first one's fetch-ahead walks (its tensors still come back, on demand).
A forward whose backward never runs keeps its saved tensors until its graph is dropped.
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
    """One saved tensor moved to the host: the copy, the event its copy-out finishes at, its bytes' place in the
    forward's saves, and (once fetched ahead) the device copy with the event its copy-in finishes at."""
    host: torch.Tensor
    device: torch.device
    copied_out: Optional[torch.cuda.Event]
    start: int  # activation bytes saved before it in this forward
    end: int
    used: bool = False  # handed to the backward once: never fetched ahead again
    fetched: Optional[torch.Tensor] = None
    copied_in: Optional[torch.cuda.Event] = None


@dataclass
class _Kept:
    """A saved tensor left where it is, with its offset: its unpack tells the fetch-ahead where the backward is."""
    tensor: torch.Tensor
    start: int


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
    last one's host copies). ``budget_bytes``: move the first tensors saved until the next would pass it (None: every
    movable one); ``ahead_bytes``: the fetch-ahead window (module docstring). ``devices``: the device types whose
    tensors move (``cuda``; the CPU tests add ``cpu``, where a copy on the host stands in for the host copy, with no
    streams). ``moved`` / ``moved_bytes``: what the last forward moved; ``left_unused``: how many of them the last
    backward never asked for; ``waited``: how many it asked for before their fetch had started."""

    def __init__(self, model: nn.Module, budget_bytes: Optional[int] = None, ahead_bytes: int = 0,
                 devices: tuple[str, ...] = ("cuda",), min_bytes: int = MIN_BYTES):
        self.budget_bytes = budget_bytes
        self.ahead_bytes = ahead_bytes
        self.devices = devices
        self.min_bytes = min_bytes
        # the storages of every parameter and buffer: a tensor saved as a view of one stays where it is
        self._frozen = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._held: list[_Held] = []  # in the order saved
        self._streams: dict = {}  # a side stream per device
        self.moved = 0
        self.moved_bytes = 0
        self.left_unused = 0  # moved tensors the last backward never asked for (released at its end)
        self.waited = 0  # moved tensors the backward asked for before any fetch-ahead had started their copy
        self._release_queued = False
        self._saved_bytes = 0  # the next saved tensor's offset
        self._full = False  # the budget is spent: nothing more moves in this forward
        self._full_at = 0  # the offset it was spent at: a save whose window ends above it can fetch nothing
        self._next = -1  # the highest index in _held the fetch-ahead has not passed

    @contextlib.contextmanager
    def hooks(self):
        self._held = []
        self._release_queued = False
        self.moved = self.moved_bytes = self.waited = self._saved_bytes = 0
        self._full = False
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self._next = len(self._held) - 1

    def _weight(self, t: torch.Tensor) -> bool:
        """A parameter or buffer, or a view of one: never moved, and not counted in the offsets (its memory is not
        freed by the backward passing it)."""
        return isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in self._frozen

    def _copyable(self, t: torch.Tensor) -> bool:
        """An activation this object moves: on one of its devices, at least ``min_bytes``, dense."""
        return t.device.type in self.devices and t.numel() * t.element_size() >= self.min_bytes and _dense(t)

    def _movable(self, t: torch.Tensor) -> bool:
        return not self._weight(t) and self._copyable(t)

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, t: torch.Tensor):
        if self._weight(t):
            return t
        start, nbytes = self._saved_bytes, t.numel() * t.element_size()
        self._saved_bytes += nbytes
        if self._full and start - max(self.ahead_bytes, nbytes) >= self._full_at:
            return t  # the backward's ask for it is too far above the moved tensors to start a fetch: no wrapper
        movable = self._copyable(t)  # not a weight: returned above
        over = self.budget_bytes is not None and self.moved_bytes + nbytes > self.budget_bytes
        if movable and not self._full and over:
            self._full, self._full_at = True, start
        if self._full or not movable:
            return _Kept(t, start)
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
        self.moved_bytes += nbytes
        self._held.append(_Held(host, t.device, event, start, start + nbytes))
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
        if not isinstance(held, (_Kept, _Held)):
            return held
        if not self._release_queued and torch._C._current_graph_task_id() != -1:
            # the first tensor this backward asks for: at its end, drop any tensor fetched ahead and never asked for
            # (a backward that stops early) and this object's list of the host copies (the graph keeps its own
            # references to them while it lives)
            torch.autograd.Variable._execution_engine.queue_callback(self._release)
            self._release_queued = True
        if isinstance(held, _Kept):
            self._fetch_ahead(held.start, held.tensor.numel() * held.tensor.element_size())
            return held.tensor
        if held.fetched is None:
            self.waited += 1
            self._fetch(held)
        out, held.fetched, held.used = held.fetched, None, True  # a second unpack (a retained graph) fetches again
        if held.device.type == "cuda":
            current = torch.cuda.current_stream(held.device)
            current.wait_event(held.copied_in)
            out.record_stream(current)  # allocated on the side stream, used and freed on this one
        self._fetch_ahead(held.start, held.end - held.start)
        return out

    def _fetch_ahead(self, start: int, nbytes: int) -> None:
        """The backward has asked for the tensor saved at ``start``: fetch every moved tensor not yet fetched that
        ends within the window below it (``ahead_bytes``, at least ``nbytes``). ``_next`` walks down ``_held`` once
        per backward, skipping what lies above the asked tensor (fetched on demand if the backward asks for it)."""
        floor = start - max(self.ahead_bytes, nbytes)
        while self._next >= 0:
            h = self._held[self._next]
            if h.start < start and h.end <= floor:
                return  # below the window: a later ask fetches it
            if h.start < start and not h.used and h.fetched is None:
                self._fetch(h)
            self._next -= 1

    def _release(self) -> None:
        self.left_unused = sum(not h.used for h in self._held)
        for h in self._held:
            h.fetched = None
        self._held = []
        self._release_queued = False
        self._next = -1
