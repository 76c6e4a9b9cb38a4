"""What a complete checkpoint directory is: ``manifest.json`` lists every file with its sha256 and size, and a
checkpoint counts only when each file matches it (:func:`verify`); :func:`incomplete_copy` tells a copy cut short from
a damaged one. ``core.checkpoint`` writes the manifest last."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
REQUIRED = ("adapter/adapter_model.safetensors", "state.pt", "controller.json", "meta.json")
SHARDED = "sharded"  # the DCP directory of a sharded checkpoint
SHARDED_INDEX = f"{SHARDED}/.metadata"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def files_of(root: Path, skip: tuple[str, ...] = ()) -> dict:
    """sha256 and size of every file under ``root``, by its path relative to ``root``, but those under its
    top-level entries named in ``skip``."""
    return {str(p.relative_to(root)): {"sha256": sha256_of(p), "size": p.stat().st_size}
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] not in skip}


def verify(ckpt_dir: str | Path) -> Optional[str]:
    """None if the checkpoint matches its manifest, else the reason it does not."""
    d = Path(ckpt_dir)
    mpath = d / MANIFEST
    if not mpath.is_file():
        return "no manifest.json (incomplete checkpoint)"
    try:  # a malformed entry is a bad checkpoint too, not an exception out of verify()
        manifest = json.loads(mpath.read_text())["files"]
        missing = [rel for rel in REQUIRED if rel not in manifest]
        expected = {rel: (int(want["size"]), str(want["sha256"])) for rel, want in manifest.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"unreadable manifest: {type(e).__name__}: {e}"
    if any(rel.startswith(f"{SHARDED}/") for rel in expected) and SHARDED_INDEX not in expected:
        missing.append(SHARDED_INDEX)
    if missing:
        return f"manifest lists no {', '.join(missing)}"
    for rel, (size, sha256) in expected.items():
        p = d / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != size:
            return f"{rel} has {p.stat().st_size} bytes, manifest says {size} (truncated?)"
        if sha256_of(p) != sha256:
            return f"{rel} checksum mismatch (corrupt)"
    return None


def incomplete_copy(ckpt_dir: str | Path) -> bool:
    """Whether a checkpoint that does not verify looks like a copy cut short: no manifest yet, one copied half, or a
    file it lists missing or shorter than it says. A crash while a checkpoint is copied into the run directory (Ray
    copies file by file) leaves one; a corrupt checkpoint (a wrong checksum or size) was whole once. Damage can look
    the same (a file deleted, a partial rsync), so only a checkpoint the run never registered
    (``core.registered``) counts as cut short."""
    d = Path(ckpt_dir)
    try:
        files = json.loads((d / MANIFEST).read_text())["files"]
        return any(not (d / rel).is_file() or (d / rel).stat().st_size < int(want["size"])
                   for rel, want in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return True
