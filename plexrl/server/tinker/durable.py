"""What the Tinker API keeps on disk so that a restarted `plexrl serve` knows its clients' sessions again: a
session (`create_session`) is written as `<root>/clients/<session>.json` (its user) before its client hears of
it, and removed when it ends. Its models are the journal's session jobs (`Registry.recover`); a session with no
model yet has only this file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from plexrl.server.tinker.records import SESSION

log = logging.getLogger(__name__)


def _file(root: Path, session_id: str) -> Path:
    return root / "clients" / f"{session_id}.json"


def keep(root: Path, session_id: str, user: str) -> None:
    """Record an open session of `user` (atomically)."""
    path = _file(root, session_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"user": user}))
    tmp.replace(path)


def forget(root: Path, session_id: str) -> None:
    """The session ended: a restart does not bring it back."""
    _file(root, session_id).unlink(missing_ok=True)


def kept(root: Path) -> list[tuple[str, str]]:
    """The (session id, user) of every session recorded and not ended; unreadable records are skipped, logged."""
    out: list[tuple[str, str]] = []
    for path in sorted((root / "clients").glob("*.json")):
        try:
            user = json.loads(path.read_text())["user"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("session record %s cannot be read (%s); skipped", path, exc)
            continue
        if SESSION.fullmatch(path.stem) and isinstance(user, str):
            out.append((path.stem, user))
    return out


__all__ = ["forget", "keep", "kept"]
