"""THE front door of every CLI: a YAML file and ``key=value`` overrides -> the final Config, with the strict build and
checks, the hardware preset (the card's, then the model family's) and the memory fit each done once (:func:`resolve`).

It reads the cards (``hardware``) and the model's config and family (``core.model``), so it sits above ``core``, on the
driver's floor; ``config`` below it stays pure and imports neither.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from raytrain_scu.config.checks import fsdp_untried, validate
from raytrain_scu.config.io import default_run_name, explicit_keys, get_dotted, load_raw
from raytrain_scu.config.law_keys import check_law_keys
from raytrain_scu.config.load import build_config
from raytrain_scu.config.schema import Config
from raytrain_scu.errors import ConfigError, MemoryFitError
from raytrain_scu.hardware.gpus import GpuInfo, detect_gpus
from raytrain_scu.hardware.memory import (
    USABLE_FRACTION,
    estimate_peak_memory_gib,
    fit_check,
    largest_batch,
    no_fit_message,
)
from raytrain_scu.hardware.presets import PRESETS, preset_for
from raytrain_scu.hardware.shape import memory_kwargs, read_model_config, shape_of


def _set(cfg: Config, key: str, value: Any) -> None:
    *path, leaf = key.split(".")
    node: Any = cfg
    for part in path:
        node = getattr(node, part)
    setattr(node, leaf, value)


def apply_preset(cfg: Config, preset_name: str, explicit: set[str],
                 gpus: Optional[list[GpuInfo]] = None) -> dict[str, tuple[Any, Any]]:
    """Set ``preset_name``'s values on ``cfg`` in place, except keys in ``explicit`` (explicit config values
    always win). ``auto`` resolves through :func:`preset_for` on ``gpus`` (default: :func:`detect_gpus`; none
    with ``scaling.use_gpu=false``) and writes the resolved name to ``hardware.preset`` so the recorded
    config says which preset ran. Returns ``{key: (old, new)}`` for every value that changed."""
    if preset_name == "none":
        return {}
    changes: dict[str, tuple[Any, Any]] = {}
    if preset_name == "auto":
        if cfg.scaling.use_gpu is False:
            gpus = []
        preset_name = preset_for(detect_gpus() if gpus is None else gpus)
        changes["hardware.preset"] = ("auto", preset_name)
        cfg.hardware.preset = preset_name
    if preset_name not in PRESETS:
        raise ConfigError(f"hardware.preset: unknown preset {preset_name!r}, expected one of "
                            f"none, auto, {', '.join(PRESETS)}")
    for key, value in PRESETS[preset_name].items():
        if key in explicit:
            continue
        old = get_dotted(cfg, key)
        if old != value:
            _set(cfg, key, value)
            changes[key] = (old, value)
    return changes


def _family_preset(cfg: Config, hf_config: Any, explicit: set[str]) -> dict[str, tuple[Any, Any]]:
    """The model family's own preset values (``core.model.families``, e.g. Granite-4.0-H's checkpointing on the torch
    path) on top of the card's, except explicit keys; {} where the model's config could not be read here (None)."""
    if hf_config is None:
        return {}
    # core.model imports torch and transformers (seconds): only with a card to fit, so that a bad config still fails
    # within a fraction of a second
    from raytrain_scu.core.model.families import family_of

    try:
        family = family_of(hf_config)
    except Exception:  # noqa: BLE001 - a missing model is reported by the pre-flight check, with its reason
        return {}
    changes = {}
    for key, value in (family.preset() if family.preset else {}).items():
        old = get_dotted(cfg, key)
        if key not in explicit and old != value:
            _set(cfg, key, value)
            changes[key] = (old, value)
    return changes


def choose_strategy(cfg: Config, shape: Optional[dict[str, int]], gpus: list[GpuInfo]) -> tuple[str, str]:
    """What ``scaling.strategy=auto`` runs, and why: fsdp where one replica of the model does not fit the smallest
    card even at ``data.batch_size=1`` (the memory estimator, with everything else as configured), there are
    workers to shard over and no option fsdp refuses is on; else ddp. Under fsdp no card ever holds the whole model
    (each rank builds it on the meta device and keeps its shards), so a model larger than one card is sharded too;
    whether each worker's share fits is the memory fit's to say (:func:`fit_to_gpu`)."""
    if not gpus:
        return "ddp", "no GPU (a CPU run): every worker holds the whole model"
    if shape is None:
        return "ddp", "the model's config could not be read here for the memory estimate"
    mem = min(g.memory_gib for g in gpus)
    kwargs = {**shape, **memory_kwargs(cfg), "shards": 1}
    kwargs.pop("batch_size")
    est = estimate_peak_memory_gib(batch_size=1, **kwargs)
    need = est["total_gib"]
    if fit_check(need, mem):
        return "ddp", (f"one replica fits the {mem:.0f} GiB card (~{need:.1f} GiB at data.batch_size=1, the memory "
                       f"estimate)")
    too_big = f"one replica needs ~{need:.1f} GiB at data.batch_size=1, more than the {mem:.0f} GiB card holds"
    if cfg.scaling.num_workers == 1:
        return "ddp", f"{too_big}, but one worker has nothing to shard over"
    untried = fsdp_untried(cfg)
    if untried:
        return "ddp", f"{too_big}, but fsdp is not built for {', '.join(untried)} yet"
    return "fsdp", (f"one replica needs ~{need:.1f} GiB at data.batch_size=1, more than {USABLE_FRACTION:.0%} of "
                    f"the {mem:.0f} GiB card: the base is sharded over the {cfg.scaling.num_workers} workers, "
                    f"rank 0's host memory holding the whole model's ~{est['weights_gib']:.1f} GiB while it fills "
                    f"the shards")


def resolve_config(path: Optional[str | Path], overrides: list[str] | tuple[str, ...] = (),
                   gpus: Optional[list[GpuInfo]] = None, *, announce: bool = False,
                   early: Optional[Callable[[Config], None]] = None) -> tuple[Config, dict[str, tuple[Any, Any]]]:
    """Load a config like :func:`config.load_config`, refuse a key set or swept for a law that no run of it uses
    (:func:`config.law_keys.check_law_keys`), run ``early`` on it (a launch's cheap checks, before the model's config
    is read: torch and transformers load there), then apply ``hardware.preset`` under the keys the YAML file and
    overrides did not set, and decide ``scaling.strategy=auto`` (:func:`choose_strategy`; with ``announce`` and a GPU,
    its line on stderr says which and why). Returns ``(cfg, {key: (old, new)})``, the preset's and the memory fit's
    changes."""
    tree = load_raw(path, overrides)
    explicit = explicit_keys(tree)
    cfg = build_config(tree, default_name=default_run_name(path))
    check_law_keys(cfg, explicit)
    if early is not None:  # no preset or fit changes a key these read (the data, the storage path)
        early(cfg)
    changes: dict[str, tuple[Any, Any]] = {}
    found = [] if cfg.scaling.use_gpu is False else (detect_gpus() if gpus is None else gpus)
    # read once, for the family's preset and the memory fit (no preset changes which model that is)
    hf_config = read_model_config(cfg) if found else None
    if cfg.hardware.preset != "none":  # (no preset sets scaling.use_gpu: `found` stays right)
        changes = apply_preset(cfg, cfg.hardware.preset, explicit, gpus=found)
        changes.update(_family_preset(cfg, hf_config, explicit))
        validate(cfg)
    shape = shape_of(hf_config)
    if cfg.scaling.strategy == "auto":  # before the fit: under fsdp each card holds a share of the model
        cfg.scaling.strategy, why = choose_strategy(cfg, shape, found)
        if announce and found:  # without a GPU it is ddp, which the run's first line shows
            print(f"[raytrain_scu] scaling.strategy=auto: {cfg.scaling.strategy} ({why})", file=sys.stderr,
                  flush=True)
    if shape is not None:  # before launch: lower a default/preset batch, or refuse an explicit one that can't fit
        changes.update(fit_to_gpu(cfg, shape, min(g.memory_gib for g in found), explicit))
        validate(cfg)
    return cfg, changes


def resolve(path: Optional[str | Path], overrides: list[str] | tuple[str, ...] = (), *,
            gpus: Optional[list[GpuInfo]] = None, announce: bool = True,
            early: Optional[Callable[[Config], None]] = None) -> Config:
    """THE way a CLI turns a YAML file and ``key=value`` overrides into the final config: strict build and checks,
    ``early`` (see :func:`resolve_config`), the hardware preset, the memory fit, each once (:func:`resolve_config`).
    With ``announce`` every value a preset or the fit changed is printed (stderr), so a run never silently differs
    from its file."""
    cfg, changes = resolve_config(path, overrides, gpus=gpus, announce=announce, early=early)
    if announce:
        for key, (old, new) in changes.items():
            print(f"[raytrain_scu] preset {cfg.hardware.preset}: {key} {old!r} -> {new!r}", file=sys.stderr,
                  flush=True)
    return cfg


def fit_to_gpu(cfg: Config, shape: dict[str, int], gpu_mem_gib: float, explicit: set[str] = frozenset(),
               usable_fraction: float = USABLE_FRACTION) -> dict[str, tuple[Any, Any]]:
    """Make ``cfg`` fit the card before training starts, in place. If the configured batch fits, nothing
    changes. If ``data.batch_size`` came from a default or a preset, it drops to the largest batch that
    fits and ``data.grad_accum`` (unless explicit) rises to keep the sequences per step. An explicit batch
    that does not fit is an error naming what would. Returns ``{key: (old, new)}``."""
    kwargs = {**shape, **memory_kwargs(cfg)}  # under fsdp each worker's share: no card holds the whole model
    batch_size = kwargs.pop("batch_size")
    total = estimate_peak_memory_gib(batch_size=batch_size, **kwargs)["total_gib"]
    if fit_check(total, gpu_mem_gib, usable_fraction):
        return {}
    if "data.batch_size" in explicit:
        raise MemoryFitError(no_fit_message(batch_size, gpu_mem_gib, usable_fraction, kwargs)
                             + sharded_fit(cfg, kwargs, batch_size, gpu_mem_gib, usable_fraction))
    best = largest_batch(gpu_mem_gib, batch_size, usable_fraction, **kwargs)
    if best < 1:
        raise MemoryFitError(no_fit_message(batch_size, gpu_mem_gib, usable_fraction, kwargs)
                             + sharded_fit(cfg, kwargs, batch_size, gpu_mem_gib, usable_fraction))
    changes: dict[str, tuple[Any, Any]] = {"data.batch_size": (batch_size, best)}
    cfg.data.batch_size = best
    if "data.grad_accum" not in explicit:
        accum = math.ceil(batch_size * cfg.data.grad_accum / best)
        changes["data.grad_accum"] = (cfg.data.grad_accum, accum)
        cfg.data.grad_accum = accum
    return changes


MAX_SHARDS = 128  # the most workers sharded_fit tries


def sharded_fit(cfg: Config, kwargs: dict[str, Any], batch_size: int, gpu_mem_gib: float,
                usable_fraction: float = USABLE_FRACTION) -> str:
    """For a memory-fit error: the fewest cards of ``gpu_mem_gib`` over which scaling.strategy=fsdp fits, at
    ``batch_size`` or at 1, whichever needs fewer (``batch_size`` on a tie); at least scaling.num_workers cards, more
    than them under fsdp; as a sentence; "" where fsdp refuses this config or no count up to MAX_SHARDS fits.
    ``kwargs``: the estimator's keywords but the batch."""
    if fsdp_untried(cfg):
        return ""
    first = cfg.scaling.num_workers + 1 if cfg.scaling.strategy == "fsdp" else max(2, cfg.scaling.num_workers)
    best = None  # (cards, batch, GiB per card)
    for batch in dict.fromkeys((batch_size, 1)):
        for n in range(first, (best[0] if best else MAX_SHARDS + 1)):
            need = estimate_peak_memory_gib(batch_size=batch, **{**kwargs, "shards": n})["total_gib"]
            if fit_check(need, gpu_mem_gib, usable_fraction):
                best = (n, batch, need)
                break
    if best is None:
        return ""
    n, batch, need = best
    return (f" Sharded, it needs {n} GPUs of {gpu_mem_gib:.0f} GiB: scaling.strategy=fsdp "
            f"scaling.num_workers={n} data.batch_size={batch} (~{need:.1f} GiB per card).")
