"""Atomic training checkpoints with exact resume.

A checkpoint is written under a temporary name, every file fsynced, a manifest of SHA-256
checksums written last, and only then renamed to `step-NNNNNN` (rename is atomic on POSIX),
so a run killed at any instant leaves either a complete checkpoint or none. On resume the
newest checkpoint whose manifest verifies is used; a damaged one is skipped, not trusted.

What a checkpoint holds: DeepSpeed's model, optimizer and LR-scheduler state (ZeRO shards
included), the step (the data position: the example order is a pure function of it), the
training log so far, and every process's RNG states.
"""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
TAG = "state"  # DeepSpeed's sub-directory inside each checkpoint


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(engine: Any, root: Path, step: int, client_state: dict[str, Any], keep: int) -> Path:
    """Collective: every process calls it. Returns the final checkpoint directory."""
    final = root / f"step-{step:06d}"
    staging = root / f".tmp-step-{step:06d}"
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    engine.save_checkpoint(str(staging), tag=TAG, client_state=client_state)
    torch.save(rng_state(), staging / f"rng-rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        for path in files:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        manifest = {
            "step": step,
            "files": {str(p.relative_to(staging)): _sha256(p) for p in files},
        }
        with open(staging / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for d in {p.parent for p in files} | {staging}:
            _fsync_dir(d)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        _fsync_dir(root)
        for old in sorted(root.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def verify(path: Path) -> bool:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        return all(_sha256(path / name) == digest for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError):
        return False


def latest(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose files match their manifest."""
    for path in sorted(root.glob("step-*"), reverse=True):
        if verify(path):
            return path
    return None


def load(engine: Any, path: Path) -> dict[str, Any]:
    """Collective. Restores everything `save` wrote; returns the client state."""
    _, client_state = engine.load_checkpoint(str(path), tag=TAG)
    if client_state is None:
        raise RuntimeError(f"{path}: DeepSpeed could not load the checkpoint")
    set_rng_state(torch.load(path / f"rng-rank{_rank()}.pt", weights_only=False))
    return client_state
