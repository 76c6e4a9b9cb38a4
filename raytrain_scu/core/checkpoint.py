"""Checkpoints: adapter + optimizer + scaler + controller + RNG + data position, written atomically with a manifest.

Layout of one checkpoint directory::

    adapter/            peft save_pretrained (safetensors) -- loadable by PeftModel.from_pretrained
    state.pt            optimizer, grad scaler, history, every rank's RNG states (python, numpy, torch, CUDA)
    controller.json     SCU controller state (JSON, readable without torch)
    meta.json           step, data position, structure signature, tokens_per_epoch
    config.yaml         the resolved config (secrets redacted)
    manifest.json       sha256 and size of every file above; written last

Under FSDP (scaling.strategy=fsdp; :func:`write_checkpoint` with ``sharded``, called by every rank) the adapter's
factors and AdamW's state are sharded: ``sharded/`` holds them in ``torch.distributed.checkpoint`` format, each rank's
own shards (``__<rank>_0.distcp``) and rank 0's index (``.metadata``); each rank writes its files into a directory of
its own, which Ray Train's upload puts together, and rank 0's manifest lists every rank's files, so a rank's missing
or damaged shard fails the verification as any file does. ``adapter/`` is the whole adapter gathered on rank 0 (what
is exported) and ``state.pt`` holds no optimizer. Loading reshards to any world size.

A directory is written under ``<dir>.partial``, each file synced (a full disk under delayed allocation says so at the
sync, not after the rename), and renamed when complete; a write that fails (a full disk: :class:`DiskFullError`,
naming the path and the free space) removes its partial directory and leaves every earlier checkpoint as it was.
Ray then copies it into the run directory file by file (not atomic there), so a checkpoint counts as complete only
when every file matches ``manifest.json`` (``core.manifest``). Loading verifies the manifest; a corrupt or truncated
latest checkpoint falls back to the newest older good one with a warning; none good is a :class:`CheckpointError`.
Rank 0 picks and every rank loads that same one.
"""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from raytrain_scu.core import fsdp
from raytrain_scu.core.crashpoints import crash_point
from raytrain_scu.core.registered import registered_checkpoints
from raytrain_scu.core.dist import all_gather_object, broadcast_object, rank
# the manifest's names stay reachable here, where the checkpoints are written and read
from raytrain_scu.core.manifest import MANIFEST, REQUIRED, SHARDED, files_of, incomplete_copy, verify  # noqa: F401
from raytrain_scu.errors import CheckpointError, DiskFullError

# what "best" means for a checkpoint (Ray's top-k, the MLflow best_checkpoint artifact): the lowest held-out DataBPT
# measured at the checkpoint's own step, which each checkpoint's report carries under this key (worker.periodic.report)
BEST_METRIC = "ckpt/val_data_bpt"
# its value for a checkpoint with no evaluation of its own: worse than any DataBPT, and finite, since Ray Train's
# snapshot of its kept checkpoints writes NaN and inf as null, which it cannot rank once a re-run reads them back
UNSCORED = sys.float_info.max


def rng_state() -> dict:
    """This process's RNG state: python, numpy, torch CPU and (when CUDA is available) its current CUDA device."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of rank ``rank``'s random draws (LoRA dropout) from ``step`` on.

    Distinct per (seed, rank, step) and independent of ``seed`` itself, which initialises LoRA identically on every
    rank: numpy's SeedSequence mixes the three, so no two ranks (or restarts) share a stream."""
    return int(np.random.SeedSequence([seed % 2**64, rank, step]).generate_state(1)[0])


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) with ``seed`` (< 2**32, e.g. :func:`rank_seed`)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_disk_full(error: BaseException) -> bool:
    """An OSError of a full disk (or quota): ENOSPC / EDQUOT, also as pyarrow words it."""
    return isinstance(error, OSError) and (error.errno in (errno.ENOSPC, errno.EDQUOT)
                                           or "No space left on device" in str(error))


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_space(path: str | Path) -> str:
    """``"<free> free of <total>"`` on the filesystem holding ``path`` (its nearest existing parent); "unknown" for
    a remote URI or an unreadable one."""
    p = Path(path)
    if "://" in str(path):
        return "free space unknown (remote storage)"
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return "free space unknown"
    return f"{_size(usage.free)} free of {_size(usage.total)}"


def disk_full(path: str | Path, what: str) -> DiskFullError:
    """The one-line error of a write that found no space: the path, the free space there, what is kept, what to do."""
    return DiskFullError(f"no space left on device writing {what} to {path} ({free_space(path)}); the checkpoints "
                         f"written before it are intact. Free space, then re-run the same command: it resumes from the "
                         f"newest good checkpoint.")


def _sync_tree(root: Path, fsync: Callable[[int], None]) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                fsync(fd)
            finally:
                os.close(fd)
            crash_point("checkpoint.fsync")


def _write_sharded(tmp: Path, *, model, optimizer) -> Optional[dict]:
    """All ranks: ``adapter/`` gathered on rank 0 and every rank's shards under ``sharded/``; returns every rank's
    shard files (sha256 and size) on rank 0, None on the others."""
    gathered = fsdp.GatheredAdapter(model)  # all ranks take part; rank 0 holds the whole adapter
    if rank() == 0:
        gathered.save_pretrained(str(tmp / "adapter"), safe_serialization=True)
        crash_point("checkpoint.adapter")
    fsdp.save_sharded(tmp / SHARDED, model=model, optimizer=optimizer)
    shards = all_gather_object(files_of(tmp / SHARDED))  # each rank's files are in its own directory
    return {f"{SHARDED}/{rel}": want for files in shards for rel, want in files.items()} if rank() == 0 else None


def _write_files(tmp: Path, *, model, optimizer, scaler, controller_state: dict, meta: dict, config_yaml: str,
                 history: list, rng_states: Optional[list], sharded: bool = False) -> None:
    tmp.mkdir(parents=True)
    shards = _write_sharded(tmp, model=model, optimizer=optimizer) if sharded else {}
    if rank() != 0 and sharded:  # rank 0 writes the rest
        return
    if not sharded:
        model.save_pretrained(str(tmp / "adapter"), safe_serialization=True)
        crash_point("checkpoint.adapter")
    torch.save({**({} if sharded else {"optimizer": optimizer.state_dict()}), "scaler": scaler.state_dict(),
                "history": history, "rng": rng_states if rng_states is not None else [rng_state()]},
               tmp / "state.pt")
    crash_point("checkpoint.state")
    (tmp / "controller.json").write_text(json.dumps(controller_state, indent=1))
    crash_point("checkpoint.controller")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    crash_point("checkpoint.meta")
    (tmp / "config.yaml").write_text(config_yaml)
    crash_point("checkpoint.config")
    manifest = {**files_of(tmp, skip=(SHARDED,)), **shards}  # every rank's shards, hashed once by their writers
    (tmp / MANIFEST).write_text(json.dumps({"step": meta["step"], "files": manifest}, indent=1))
    crash_point("checkpoint.manifest")


def write_checkpoint(out_dir: str | Path, *, model, optimizer, scaler, controller_state: dict, step: int,
                     position: int, structure: dict, tokens_per_epoch: int, config_yaml: str,
                     history: list, extra: Optional[dict] = None, rng_states: Optional[list] = None,
                     fsync: Callable[[int], None] = os.fsync, sharded: bool = False) -> Path:
    """Write a complete checkpoint to ``out_dir`` atomically (``out_dir.partial``, synced, then renamed).

    ``rng_states``: every rank's :func:`rng_state`, in rank order (the writer gathers them); default: this process's
    alone (a one-process run). ``fsync``: syncs one file descriptor (fault injection replaces it). A write that fails
    removes ``out_dir.partial``; a full disk raises :class:`DiskFullError`. ``sharded``: an FSDP model, every rank
    calls it with a directory of its own (the module docstring's layout); rank 0's holds all but the other ranks'
    shards."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".partial")
    crash_point("checkpoint.begin")
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {"step": step, "position": position, "structure": structure, "tokens_per_epoch": tokens_per_epoch,
            **(extra or {})}
    try:
        _write_files(tmp, model=model, optimizer=optimizer, scaler=scaler, controller_state=controller_state,
                     meta=meta, config_yaml=config_yaml, history=history, rng_states=rng_states, sharded=sharded)
        _sync_tree(tmp, fsync)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write gives its space back
        if is_disk_full(e):
            raise disk_full(tmp, f"the checkpoint of step {step}") from e
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    crash_point("checkpoint.renamed")
    return out


def read_meta(ckpt_dir: str | Path) -> dict:
    return json.loads((Path(ckpt_dir) / "meta.json").read_text())


# structure keys newer than some checkpoints: what one without the key was made with; None (unknown) matches anything
STRUCTURE_ADDED = {"quant.embedding_int8": False, "controller.law": "spec", "model.init_device": None}
# how a difference in a key is said (from the saved value and the run's), and what resumes the checkpoint (from its)
DIFFERENCE = {"model.init_device": "its preset base was drawn on {!r}, this run draws it on {!r}".format}
DRAWN_ON = {"cuda": "set scaling.strategy=ddp on GPU workers (as GPU ddp workers, it drew its preset base on CUDA)",
            "cpu": "set scaling.strategy=fsdp (as under fsdp or CPU workers, it drew its preset base on the CPU)"}
RESUME_WITH = {"controller.law": "set controller.law={}".format,
               "model.init_device": lambda device: DRAWN_ON.get(device, f"draw its preset base on {device}")}


def check_structure(meta: dict, structure: dict) -> None:
    """Refuse a checkpoint made for a different base model (or preset draw) / LoRA shape / block size / law."""
    saved = {**STRUCTURE_ADDED, **meta.get("structure", {})}
    diffs = [DIFFERENCE.get(k, f"{k}: checkpoint has {{!r}}, config has {{!r}}".format)(saved.get(k), v)
             for k, v in structure.items() if k not in saved or saved[k] not in (v, None)]
    if diffs:
        keep = "".join(f" To resume it, {fix(saved[k])}." for k, fix in RESUME_WITH.items()
                       if k in structure and saved.get(k) not in (structure[k], None))
        raise CheckpointError("cannot resume: the checkpoint was made for a structurally different run ("
                              + "; ".join(diffs) + ")." + keep + " Use a new run.name to start fresh.")


def check_sharding(ckpt_dir: str | Path, *, sharded: bool) -> None:
    """Refuse to resume a checkpoint written with every worker holding the whole model (ddp) in a run that shards
    it (``sharded``: scaling.strategy=fsdp). A sharded checkpoint resumes under either strategy."""
    d = Path(ckpt_dir)
    if sharded and not (d / SHARDED).is_dir():
        raise CheckpointError(f"cannot resume: {d.name} was written by a run whose workers each held the whole "
                              f"model (scaling.strategy=ddp), and this run shards it (scaling.strategy=fsdp); resume "
                              f"it with scaling.strategy=ddp")


def load_training_state(ckpt_dir: str | Path, *, model, optimizer, scaler, rank: int = 0, world_size: int = 1,
                        map_location="cpu") -> dict:
    """Restore adapter weights, optimizer, scaler and this rank's RNG from a verified directory; returns meta +
    controller + history, and ``rng_ranks``: how many ranks' RNG states the checkpoint holds. The RNG is restored only
    when that equals ``world_size``; otherwise (a changed world size, or a checkpoint from before per-rank states,
    counted as 0) the caller must seed the ranks itself.

    A sharded checkpoint (``sharded/``: all ranks call it then) loads into an FSDP model or a whole one, at any world
    size; an FSDP model does not load an unsharded one."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    state = torch.load(d / "state.pt", map_location=map_location, weights_only=False)
    if (d / SHARDED).is_dir():
        fsdp.load_sharded(d / SHARDED, model=model, optimizer=optimizer)
    elif fsdp.is_sharded(model.parameters()):
        check_sharding(d, sharded=True)
    else:
        result = set_peft_model_state_dict(model, load_file(str(d / "adapter" / "adapter_model.safetensors")))
        missing = [k for k in getattr(result, "unexpected_keys", [])]
        if missing:
            raise CheckpointError(f"adapter in {d} has keys the model lacks: {missing[:5]}")
        optimizer.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    # one state per rank, in rank order; an older checkpoint holds one dict, rank 0's alone: counted as none
    rngs = state["rng"] if isinstance(state["rng"], list) else []
    if len(rngs) == world_size:
        set_rng_state(rngs[rank])
    meta = read_meta(d)
    meta["controller"] = json.loads((d / "controller.json").read_text())
    meta["history"] = state.get("history", [])
    meta["rng_ranks"] = len(rngs)
    return meta


def data_facts(*, streamed: bool, plan: str) -> dict:
    """What a checkpoint's meta keeps of how its data was read: whether in shards, and the shard plan's fingerprint
    (:func:`check_tokens_per_epoch` names what changed from them)."""
    return {"data_streamed": streamed, "data_plan": plan}


def check_tokens_per_epoch(meta: dict, *, measured: int, override: int, streamed: bool, plan: str) -> Optional[str]:
    """Refuse to resume when the data's tokens per epoch (N of ParamBPT, so S) is not the checkpoint's.

    ``measured``: the training split's count now, or (``streamed``: a source read in shards) its estimate, which the
    same files, tokenizer, block size, seed and data.shard_bytes give again exactly; ``plan``: that source's shard
    plan fingerprint ("" read whole), which the refusal compares with the checkpoint's (:func:`data_facts`) to say
    what changed; ``override``: controller.tokens_per_epoch (0 = none). A set override wins: returns a warning when
    it differs from the checkpoint's value, else None."""
    saved = meta["tokens_per_epoch"]
    if override:
        if override == saved:
            return None
        return (f"controller.tokens_per_epoch={override} overrides the checkpoint's tokens_per_epoch={saved}: "
                f"ParamBPT and S change by x{saved / override:.4g} from step {meta['step']} on")
    if measured != saved:
        how = {True: "read in shards", False: "read whole"}
        # a checkpoint without these keys says nothing of how its data was read
        if "data_streamed" in meta and meta["data_streamed"] != streamed:
            what = (f"the checkpoint's source was {how[meta['data_streamed']]} and is now {how[streamed]} "
                    f"(data.streaming, auto above STREAM_ABOVE_BYTES)")
        elif streamed and meta.get("data_plan", plan) != plan:
            what = "the source's shard plan changed (data.shard_bytes, or the files)"
        else:
            what = "did data.* change?"
        raise CheckpointError(
            f"cannot resume: the checkpoint was written with tokens_per_epoch={saved} but the data now gives "
            f"{'an estimated ' if streamed else ''}tokens_per_epoch={measured} ({what}); ParamBPT and S "
            f"scale with it, so they would change silently. Restore the data settings, set "
            f"controller.tokens_per_epoch={saved} to keep the checkpoint's scale on the new data, or use a new "
            f"run.name to start fresh.")
    return None


def _newest_good(dirs, where: str, *, registered: Optional[set[str]] = None
                 ) -> tuple[Optional[tuple[str, Path]], list[str]]:
    """The first ``(label, local dir)`` of ``dirs`` (newest first) that verifies, and the problems of those before it.

    (None, []) when ``dirs`` is empty; CheckpointError when none verifies, but (None, problems) when every one is a
    copy cut short (:func:`incomplete_copy`) whose label is not in ``registered``, the names the run registered
    (None: none counts as cut short). ``dirs`` may be lazy: a remote checkpoint is materialised only when the newer
    ones were bad."""
    problems, cut_short = [], registered is not None
    for label, local in dirs:
        why = verify(local)
        if why is None:
            return (label, local), problems
        problems.append(f"{label}: {why}")
        cut_short = cut_short and label not in registered and incomplete_copy(local)
    if problems and not cut_short:
        raise CheckpointError(f"no usable checkpoint{where}: " + "; ".join(problems)
                              + ". Delete the run directory or use a new run.name to start fresh.")
    return None, problems


def open_good_checkpoint(candidates: list[tuple[str, Callable[[], Path]]]) -> tuple[Path, list[str]]:
    """The local directory of the newest checkpoint that verifies, the same one on every rank; returns (local dir,
    warnings).

    ``candidates``: ``(name, open)`` pairs, newest first, the given (latest) checkpoint first: ``name`` is the same on
    every rank (``checkpoint_00000020``), ``open()`` makes the checkpoint local and returns its directory (called only
    for those looked at). Rank 0 picks (a bad latest falls back to an older one, with a warning) and broadcasts the
    name and step; every other rank opens that one, verifies it and checks its step. A rank never picks for itself: its
    own download of the latest could be the one that failed. Raises CheckpointError on every rank when none is good or
    any rank cannot use rank 0's pick; each rank's outcome is all-gathered first, so no rank waits on one that gave
    up."""
    pick, error = None, None
    if rank() == 0:
        try:
            dirs = ((name, open_()) for name, open_ in candidates)
            (name, inner), problems = _newest_good(dirs, "")  # never empty: the given checkpoint comes first
            pick = {"name": name, "step": read_meta(inner)["step"], "problems": problems}
        except Exception as e:  # noqa: BLE001 - every rank must reach the broadcast; raised below on all of them
            error = e
    pick, why_not = broadcast_object((pick, None if error is None else f"{type(error).__name__}: {error}"))
    if error is not None:
        raise error
    if why_not is not None:
        raise CheckpointError(f"rank 0 found no checkpoint to resume from ({why_not})")
    mine = None  # None: this rank holds rank 0's pick, verified, at rank 0's step
    if rank() != 0:
        try:
            same = [open_ for name, open_ in candidates if name == pick["name"]]
            if not same:
                mine = "it does not see that checkpoint"
            else:
                inner = same[0]()
                mine = verify(inner)
                if mine is None and read_meta(inner)["step"] != pick["step"]:
                    mine = f"its meta.json says step {read_meta(inner)['step']}"
        except Exception as e:  # noqa: BLE001 - a failed download here must not leave the other ranks waiting
            mine = f"{type(e).__name__}: {e}"
    failures = [f"rank {r}: {why}" for r, why in enumerate(all_gather_object(mine)) if why is not None]
    if failures:
        raise CheckpointError(f"cannot resume: rank 0 picked {pick['name']} (step {pick['step']}) but not every rank "
                              f"can use it ({'; '.join(failures)}); ranks must resume from the same step. A failed "
                              f"download is retried with the run (run.max_failures); if it persists, check the "
                              f"storage.")
    if pick["problems"] and rank() == 0:
        warnings.warn("skipped bad checkpoint(s): " + "; ".join(pick["problems"]) + f"; resuming from {pick['name']}")
    return inner, pick["problems"]


def newest_good_local(run_dir: str | Path) -> tuple[Optional[Path], list[str]]:
    """The newest ``checkpoint_*`` under a local run directory that verifies, and the problems of newer ones.

    (None, []) when there is no checkpoint at all; (None, problems) when every one is a copy cut short that the run
    never registered (``core.registered``: a crash while the first was copied; the run starts afresh, as
    Ray, which hands the workers no checkpoint then, does); CheckpointError when there are some but none is good,
    among them a registered one (damaged after its copy: Ray would hand the workers that one)."""
    # Training writes a checkpoint under <dir>.partial in its own temp dir (loop.py: new_local_dir) and Ray copies
    # the finished one here, so a .partial here is only a direct write_checkpoint into the run directory that died
    # half-way: never a candidate.
    dirs = ((d.name, d) for d in sorted(Path(run_dir).glob("checkpoint_*"), reverse=True)
            if d.is_dir() and not d.name.endswith(".partial"))
    good, problems = _newest_good(dirs, f" in {run_dir}", registered=registered_checkpoints(run_dir))
    return (good[1] if good else None), problems


def new_local_dir(prefix: str = "raytrain_scu_ckpt_") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
