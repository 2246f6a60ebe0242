"""Where a server's jobs may read and write (`ServerFiles`): the one source of each user's `FilePolicy`
(`plexrl.paths`), used both where a submission is checked and where its files are opened (preparation, data
reads), so that the two agree.

- Every job may read under `allowed_roots` (default: the server's `run_dir`) and never in the server's own files:
  the journal (and its -wal/-shm) and the checkpoint directory.
- With private jobs (`private_jobs`, on by default with `users`), each user has a directory of their own,
  `<run_dir>/users/<user>/`: a job's `run_dir` defaults to it and must lie in it (its caches, warm-started and
  finished models, MLflow store and data caches go there), `data.cache_dir` likewise, and nothing else under the
  server's `run_dir` may be named, read or write: not another user's directory (bob cannot use ann's
  finished model as his `model.path`, his LoRA base or his cache dir, even though ann's job id is public).
  Files the owner shares (a data directory among `allowed_roots`, outside `run_dir`) stay readable by all.
- Without private jobs every job writes under the roots, as before.

A user's name becomes a directory name only when it is a plain one (letters, digits, `_`, `.`, `-`, not `.` or
`..`); any other gets `u-<hash>`. What this module does NOT do: check anything itself (`plexrl.paths` and
`submissions.py` do), or remove a user's files.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from plexrl.paths import FilePolicy, resolve
from plexrl.server.config import ServerConfig

PLAIN = re.compile(r"[A-Za-z0-9_.-]{1,64}", re.ASCII)


class ServerFiles:
    """See the module docstring: per-user directories and policies of the server configured by `cfg`."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.private = cfg.jobs_private()
        self.base = resolve(cfg.run_dir)
        self.roots = tuple(cfg.roots())
        journal = resolve(cfg.journal)
        self.denied = (journal, Path(f"{journal}-wal"), Path(f"{journal}-shm"), cfg.checkpoints())
        self.max_bytes, self.max_line_bytes = int(cfg.limits.max_data_bytes), int(cfg.limits.max_line_bytes)

    def user_dir(self, user: str) -> Path:
        """The user's own directory (`<run_dir>/users/<user>`; a name that is not plain: `u-<hash>`)."""
        name = user if PLAIN.fullmatch(user) and user not in (".", "..") else "u-" + _digest(user)
        return self.base / "users" / name

    def run_dir(self, user: str) -> Path:
        """The default `run_dir` of the user's jobs: their own directory with private jobs, else the server's."""
        return self.user_dir(user) if self.private else self.base

    def policy(self, user: str) -> FilePolicy:
        """The `FilePolicy` of the user's jobs (see the module docstring)."""
        own = self.user_dir(user) if self.private else None
        denied = (*self.denied, self.base) if self.private else self.denied
        return FilePolicy(self.roots, own, denied, self.max_bytes, self.max_line_bytes)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


__all__ = ["ServerFiles"]
