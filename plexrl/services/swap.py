"""Moving one job's state tensors between tiers: device (the engine's working tensors), host (CPU copies,
pinned on CUDA) and disk (one safetensors file per job). The service calls these to carry out the
StateManager's moves; nothing here decides anything.

A move swaps tensor *storage* in place (`t.data = ...`): the engine, its modules and its optimizer keep
their tensor objects, so nothing needs rebuilding and the optimizer's per-parameter state stays attached.
On CPU the device tier is the engine's working copy: a move still copies every byte into a fresh buffer
and frees the old one, so budgets, accounting and bandwidth mean the same as on CUDA.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor


class StateCorrupted(RuntimeError):
    """A job's state read back from host or disk differs from what was written (validate mode)."""


@dataclass(slots=True)
class Placement:
    """Where one job's state is now, with its host copies or spill file when it is off device."""

    tier: str = "device"
    host: dict[str, Tensor] | None = None
    disk: Path | None = None
    checksum: str | None = None
    nbytes: int = 0


def nbytes(tensors: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def checksum(tensors: dict[str, Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(name.encode())
        h.update(t.to("cpu").contiguous().view(torch.uint8).numpy().data)  # the buffer itself, no extra copy
    return h.hexdigest()


def device_to_host(live: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    """Copy every live tensor to a new host buffer, then free the device storage."""
    pin = device.type == "cuda"
    host = {}
    for name, t in live.items():
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t.detach(), non_blocking=pin)
        host[name] = buf
    if pin:
        torch.cuda.current_stream(device).synchronize()
    for t in live.values():
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    return host


def host_to_device(live: dict[str, Tensor], host: dict[str, Tensor], device: torch.device) -> None:
    """Give every live tensor fresh device storage filled from its host copy."""
    missing = set(live) - set(host)
    if missing:
        raise StateCorrupted(f"host copy lacks {sorted(missing)[:3]}")
    pin = device.type == "cuda"
    for name, t in live.items():
        src = host[name]
        buf = torch.empty(src.shape, dtype=src.dtype, device=device)
        buf.copy_(src, non_blocking=pin)
        t.data = buf
    if pin:
        torch.cuda.current_stream(device).synchronize()


def host_to_disk(host: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in host.items()}, str(path))


def disk_to_host(path: Path, pin: bool) -> dict[str, Tensor]:
    """Read a spilled state back. On CPU safetensors maps the file and the bytes are read by the next copy
    (host -> device); the file is unlinked at once and its pages live until that copy drops the mapping."""
    from safetensors.torch import load_file

    host = load_file(str(path))
    path.unlink()
    if pin:
        host = {k: v.pin_memory() for k, v in host.items()}
    return host


def read_spill(path: Path | None) -> dict[str, Tensor]:
    """A spilled state's tensors, read without consuming the file (a checkpoint of a job on disk)."""
    from safetensors.torch import load_file

    if path is None:
        raise StateCorrupted("the job is on disk but has no spill file")
    return load_file(str(path))


def save_checkpoint(obj: dict[str, object], path: Path) -> Path:
    """`torch.save` `obj` to `path` atomically: a temp file in the same directory, fsynced, renamed over
    `path`, the directory fsynced. On any error the temp file is removed and `path` is left as it was."""
    import os

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def load_checkpoint(path: Path) -> dict[str, Any]:
    """What `save_checkpoint` wrote (tensors and plain data only: `weights_only=True`)."""
    out: dict[str, Any] = torch.load(str(path), map_location="cpu", weights_only=True)
    return out
