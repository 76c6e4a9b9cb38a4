"""GPTQ rounding for the FP8 frozen base (``model.fp8_rounding=gptq``): the forward copy's e4m3 codes chosen so the
layer's output on real inputs moves least, instead of each weight rounded to its nearest code. No ray, mlflow or
torch.distributed.

The codes keep fp8.py's row scales and runtime GEMM; only which e4m3 value each weight gets changes. GPTQ (Frantar
et al., 2022) rounds the input columns one at a time and spreads each column's rounding error over the columns not
yet rounded, weighted by the inverse of the input second moment H = E[x xᵀ] from calibration blocks: correlated
inputs let a later column cancel an earlier one's error in the product. On the real SmolLM2-135M (H200) this took the
FP8 forward's held-out cost before training from 0.040 to 0.018 bits (docs/log/benchmarks.md).

Calibration is sequential by decoder layer: layer i's projections see the inputs that layer i-1, already in FP8,
gives them, as at training time. Each pass runs the model in eval mode up to the end of the layer being calibrated and
stops there, so calibrating L layers costs about L/2 forwards of the calibration blocks; one layer's second moments
(K x K float32 per projection) are held at a time. The per-column loop dominates the cost: 51 s for the Llama-3.2-1B
shape's 112 projections on an H200. The input-grad copy stays the nearest rounding of the bf16 weight (fp8.to_fp8):
the backward is the bf16 model's gradient, as with nearest codes.

The codes are cached on disk (``cache``): keyed by the bytes of every tensor of the model (its adapters too: a
calibration forward runs them), the calibration token ids, the adapted projections' names, the card's name and the
torch version, so a restart, a resumed run or another trial of the same model, seed and data reads them in seconds
instead of calibrating again.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional

import torch
import torch.nn as nn

from raytrain_scu.core.dist import notice0
from raytrain_scu.core.fp8 import E4M3, E4M3_MAX, check_fp8_device, fp8_targets, to_fp8
from raytrain_scu.core.model.parts import base_of, decoder_layers
from raytrain_scu.core.model.source import file_lock
from raytrain_scu.errors import ModelError

BLOCK = 128  # columns rounded between two rank-BLOCK updates of the rest (GPTQ's lazy batch update)
DAMP = 0.01  # the fraction of H's mean diagonal added to its diagonal: keeps the Cholesky factor well conditioned
CODES_VERSION = 1  # part of the cache key: raised whenever the codes the same inputs give change


def gptq_codes(weight: torch.Tensor, hessian: torch.Tensor, *, damp: float = DAMP):
    """e4m3 codes [N, K] and float32 row scales [N, 1] for ``weight`` [N, K], its rows scaled as fp8.quantize_rows
    scales them (largest magnitude to 448), its codes chosen by GPTQ against ``hessian`` [K, K] (the inputs' second
    moment, float32). With a diagonal ``hessian`` no error moves between columns and the codes are the nearest ones; an
    input that was always zero in calibration gets its nearest codes too."""
    w = weight.detach().float().clone()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    inv, scale = E4M3_MAX / amax, amax / E4M3_MAX
    h = hessian.detach().float().to(w.device).clone()
    dead = torch.diagonal(h) == 0  # inputs that were always zero: their error costs nothing, so none is spread
    h[dead, dead] = 1.0
    u = _inverse_cholesky(h, damp)
    codes = torch.empty(w.shape, dtype=E4M3, device=w.device)
    k = w.shape[1]
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        w1, u1 = w[:, i1:i2].clone(), u[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            c = (w1[:, i:i + 1] * inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
            codes[:, i1 + i:i1 + i + 1] = c
            err = (w1[:, i:i + 1] - c.float() * scale) / u1[i, i]
            w1[:, i:] -= err * u1[i:i + 1, i:]
            err1[:, i:i + 1] = err
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    return codes, scale


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damping)⁻¹; the damping grows tenfold (up to three times) where H is too
    ill-conditioned to factor."""
    mean_diag = torch.diagonal(h).mean()
    for attempt in range(4):
        hd = h.clone()
        hd.diagonal().add_(damp * 10 ** attempt * mean_diag)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if int(info) == 0:
                return upper
    raise ModelError(f"model.fp8_rounding=gptq: a calibration input's second moment ({h.shape[0]} x {h.shape[0]}) is "
                     f"not positive definite even damped by {damp * 1000:g} x its mean diagonal; set "
                     f"model.fp8_rounding=nearest")


class _Stop(Exception):
    """Raised by a hook after the last layer a calibration pass needs: the rest of the forward is not run."""


def _raise_stop(module, args, output):
    raise _Stop


def _second_moments(model, bases: list[nn.Linear], stop_after, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of ``bases``' input second moment E[x xᵀ] (float32) over ``batches`` (token ids on the model's device), the
    forward stopping after ``stop_after`` (None: the whole model)."""
    sums = [torch.zeros(b.in_features, b.in_features, device=b.weight.device) for b in bases]
    rows = [0] * len(bases)

    def hook_for(i):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            sums[i].addmm_(x.t(), x)
            rows[i] += x.shape[0]
        return hook

    handles = [b.register_forward_pre_hook(hook_for(i)) for i, b in enumerate(bases)]
    if stop_after is not None:
        handles.append(stop_after.register_forward_hook(_raise_stop))
    try:
        with torch.no_grad():
            for ids in batches:
                try:
                    model(input_ids=ids)
                except _Stop:
                    pass
    finally:
        for h in handles:
            h.remove()
    return [s / max(n, 1) for s, n in zip(sums, rows)]


def convert_base_to_fp8_gptq(model, batches: Iterable[torch.Tensor], exclude=(),
                             cache: Optional[Path] = None) -> int:
    """:func:`fp8.convert_base_to_fp8` with each forward copy's codes chosen by GPTQ on ``batches`` (token ids, on the
    model's device, at least one), layer after layer (see the module docstring), in eval mode (the model's modes are
    restored after); returns how many were converted. ``cache``: a directory where the codes of this model, these
    batches and this card are read if present, else computed and written (under a lock, so ranks of one machine
    calibrate once); a cache that cannot be made, read or written is said in one line, and the codes computed then
    serve this run alone. Raises ModelError as that does, or naming model.fp8_rounding. Rank 0 says what it
    calibrates or reads, and how long it took."""
    batches = list(batches)
    if not batches:
        raise ModelError("model.fp8_rounding=gptq needs at least one calibration block (model.fp8_calibration_blocks)")
    targets = fp8_targets(model, exclude)
    device = targets[0][1].weight.device
    check_fp8_device(device)
    if cache is None:
        _calibrate(model, batches, targets)
        return len(targets)
    began = time.perf_counter()
    path = Path(cache) / f"{codes_key(model, batches, targets)}.safetensors"
    try:
        lock = file_lock(path)
        lock.acquire()
    except OSError as e:  # an unwritable cache directory: the codes are computed and kept in memory only
        notice0(f"model.fp8_rounding=gptq: the codes cache {path.parent} cannot be used ({e}); calibrating without it")
        _calibrate(model, batches, targets)
        return len(targets)
    try:
        codes = _read_codes(path, targets, device)
        if codes is None:
            _calibrate(model, batches, targets)
            _write_codes(path, targets)
            return len(targets)
    finally:
        lock.release()
    for name, base in targets:
        to_fp8(base, codes=codes[name])
    notice0(f"model.fp8_rounding=gptq: the e4m3 codes of {len(targets)} projections read from the cache in "
            f"{time.perf_counter() - began:.1f} s, hashing the model included ({path}: this model, its adapters' "
            f"initial values, the calibration blocks and the card)")
    return len(targets)


def _calibrate(model, batches: list[torch.Tensor], targets: list[tuple[str, nn.Linear]]) -> None:
    """GPTQ's codes for ``targets``, layer after layer, each base converted in place."""
    layers = decoder_layers(model)
    if not layers:
        notice0(f"{type(base_of(model)).__name__} has no decoder `layers` list: GPTQ calibrates all {len(targets)} "
                f"projections in one pass, on the bf16 model's inputs, holding every second moment at once")
    groups, placed = [], set()
    for layer in layers:
        inside = {id(m) for m in layer.modules()}
        group = [base for _, base in targets if id(base) in inside]
        if group:
            groups.append((layer, group))
            placed.update(id(b) for b in group)
    rest = [base for _, base in targets if id(base) not in placed]
    if rest:  # outside any decoder layer: calibrated on a whole forward, after the layers
        groups.append((None, rest))
    notice0(f"model.fp8_rounding=gptq: choosing the e4m3 codes of {len(targets)} projections on "
            f"{sum(len(b) for b in batches)} calibration blocks, layer by layer")
    began, modes = time.perf_counter(), [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        for stop_after, group in groups:
            moments = _second_moments(model, group, stop_after, batches)
            for base, h in zip(group, moments):
                to_fp8(base, codes=gptq_codes(base.weight, h))
    finally:
        for m, training in modes:
            m.training = training
    notice0(f"model.fp8_rounding=gptq: {len(targets)} projections in FP8 after {time.perf_counter() - began:.0f} s")


# ---------------------------------------------------------------- the codes' cache

def _bytes(t: torch.Tensor):
    return t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy()


def card_class(device: torch.device) -> str:
    """What the codes' float sums depend on besides their inputs: the card's name (every card of a class computes the
    same sums) or ``cpu``."""
    return f"cuda {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def codes_key(model, batches: list[torch.Tensor], targets: list[tuple[str, nn.Linear]]) -> str:
    """The codes' identity: every tensor's name, dtype, shape and bytes (the adapters' initial values too), the model's
    config (norm epsilons, rope settings, the attention function), the calibration token ids, the adapted
    projections' names, the card class, torch's, CUDA's and transformers' versions and the method's constants. Every
    rank hashes its model on the host: a few seconds at 1B, about 16 GB read at 8B."""
    import transformers

    device = targets[0][1].weight.device
    h = hashlib.sha256(f"v{CODES_VERSION}|block {BLOCK}|damp {DAMP}|{card_class(device)}|torch {torch.__version__}|"
                       f"cuda {torch.version.cuda}|transformers {transformers.__version__}|"
                       f"{base_of(model).config.to_json_string(use_diff=False)}".encode())
    tensors = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    for name, t in sorted(tensors, key=lambda kv: kv[0]):
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(_bytes(t))
    h.update("|".join(name for name, _ in targets).encode())
    for ids in batches:
        h.update(f"|{tuple(ids.shape)}|".encode())
        h.update(_bytes(ids.to(torch.int64)))
    return h.hexdigest()[:24]


def _write_codes(path: Path, targets: list[tuple[str, nn.Linear]]) -> None:
    """Each converted target's forward codes and row scales, written whole or not at all (one byte a weight: about
    1 GB at 1B, 7 GB at 8B). A write that fails (a full disk, no permission) is said in one line; the run goes on with
    the codes it holds."""
    from safetensors.torch import save_file

    tensors = {}
    for name, base in targets:
        tensors[f"{name}.codes"] = base.fp8_weight.detach().contiguous().cpu()
        tensors[f"{name}.scale"] = base.fp8_weight_scale.detach().t().contiguous().cpu()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        save_file(tensors, tmp)
        os.replace(tmp, path)
        tmp = None
        notice0(f"model.fp8_rounding=gptq: codes cached in {path}")
    except OSError as e:
        notice0(f"model.fp8_rounding=gptq: the codes could not be cached in {path} ({e}); this run goes on with them")
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _read_codes(path: Path, targets: list[tuple[str, nn.Linear]], device: torch.device):
    """{name: (codes e4m3 [N, K], scales [N, 1])} from ``path`` on ``device``; None when there is no file. A file that
    cannot be read or does not match the targets is said in one line, removed and computed again."""
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    try:
        t = load_file(str(path), device=str(device))
        out = {}
        for name, base in targets:
            codes, scale = t[f"{name}.codes"], t[f"{name}.scale"]
            if codes.shape != base.weight.shape or scale.shape != (base.weight.shape[0], 1):
                raise ValueError(f"{name}: codes {tuple(codes.shape)} for a weight {tuple(base.weight.shape)}")
            out[name] = (codes.view(E4M3), scale)
        return out
    except Exception as e:  # noqa: BLE001 - a damaged cache file is computed again, never used
        notice0(f"model.fp8_rounding=gptq: the cached codes {path} cannot be used ({type(e).__name__}: "
                f"{str(e)[:200]}); calibrating again")
        path.unlink(missing_ok=True)
        return None
