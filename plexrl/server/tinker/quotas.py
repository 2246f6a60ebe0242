"""What a Tinker request may name and write, per user: a base model (a served name, or a directory the user's
`FilePolicy` allows: the job API's, `plexrl/server/files.py`), and files only while the disk has room
(`min_free_disk`, as `POST /jobs`) and the user keeps fewer saved bytes than `max_saved_bytes_per_user`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plexrl.paths import FilePolicy, resolve
from plexrl.server.tinker import catalog
from plexrl.server.tinker.decode import Refused


def check_base(name: Any, models: list[str], roots: list[Path], policy: FilePolicy | None) -> None:
    """Refused (400) unless `name` is a name some entry of `models` serves (`catalog.names_of`) or a model
    directory (with a config.json) that `policy` allows (None: the administrator, anywhere under `roots`).
    Every path refused gets one answer, whether it exists or not: nothing outside the policy is looked at."""
    if not isinstance(name, str) or not name or len(name) > 4096 or "\0" in name:
        raise Refused(400, "base_model must be a model name or a directory path (at most 4096 characters)")
    if catalog.entry_of(models, name) is not None:
        return
    if "/" in name and not name.startswith("~"):
        try:
            path = resolve(name)
            if policy is not None:
                allowed = policy.problem(path, False) is None
            else:
                allowed = any(path.is_relative_to(r) for r in roots)
            if allowed and (path / "config.json").is_file():
                return
        except (OSError, ValueError):  # (a name too long for the file system, ...: like any unknown path)
            pass
    names = ", ".join(n for e in models for n in catalog.names_of(e)) or "none by name"
    raise Refused(400, f"unknown base_model {name[:300]!r}: this server trains {names}, or a model directory "
                       "under its allowed roots that is yours or shared")  # fmt: skip


def saved_bytes(root: Path, user: str) -> int:
    """Bytes of the saved files (states, sampler weights, snapshots) of `user`'s models under `root`."""
    total = 0
    for owner in root.glob("*/owner.json") if root.is_dir() else ():
        try:
            if json.loads(owner.read_text()).get("user") != user:
                continue
            total += sum(f.stat().st_size for f in owner.parent.rglob("*") if f.is_file())
        except (OSError, ValueError):
            continue
    return total


def check_writes(disk: Callable[[], str | None] | None, root: Path, user: str | None, most: int) -> None:
    """Refused when the disk is too full (503, as `POST /jobs` is; `disk`: why, or None) or `user` keeps `most`
    saved bytes or more under `root` (413)."""
    full = disk() if disk is not None else None
    if full is not None:
        raise Refused(503, f"the server writes nothing now: {full}")
    if user is None:
        return
    kept = saved_bytes(root, user)
    if kept >= most:
        raise Refused(413, f"user {user!r} keeps {kept} bytes of saved states and sampler weights, this server's "
                           "tinker.max_saved_bytes_per_user; save over an old name (overwrite=True), or ask the "
                           "server's owner to raise it")  # fmt: skip


__all__ = ["check_base", "check_writes", "saved_bytes"]
