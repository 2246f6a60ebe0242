"""One way from a path a config names to a file: `resolve` (THE resolution: `~` expanded, made absolute, links
followed) everywhere a job's path is checked or opened, and, where a server prepares or runs a job, a
`FilePolicy` in force (`file_policy(...)`, a context variable, as `roles.allowed_modules` is) that every opening
place checks AGAIN at the moment it opens (`check_path`, `open_file`, `check_tree`), so that a path checked at
submission cannot lead elsewhere later:

- the real path must lie under the policy's roots (a data file swapped for a link after the submission was
  checked, or a journalled job after the owner narrowed `allowed_roots` and restarted: refused there);
- `~` is refused (a server's home is not its user's; the submission check refuses it too);
- the user's own directory (`own`) is the only place a job may write when it is set, and `denied` directories
  (the server's journal and checkpoints; with private jobs the other users' directories) are refused, read or
  write, unless under `own`;
- only regular files and directories are opened: a FIFO, a device or a socket is refused without blocking (the
  open is non-blocking, the check is on the descriptor that was opened, `fstat`);
- a file over `max_bytes` is refused before it is read, and `read_lines` reads lines of at most
  `max_line_bytes`: a 1.5 GiB file with no newline is one refusal, not one 1.5 GiB line in memory.

Without a policy (`plexrl run`, `validate`) only the resolution, the special-file refusal and the line bound
apply. Refusals are `PathRefused` (a `ConfigError`): the server fails the job (or refuses the submission) with
the reason, which names the field and the rule, and says nothing of what the file holds. What this module does
NOT do: decide the roots (`plexrl.server`), or sandbox code that opens files itself (an allowed user module).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from plexrl.errors import ConfigError, Problem

MAX_LINE_BYTES = 64 << 20  # without a policy: the longest line `read_lines` accepts
MAX_TREE_ENTRIES = 10_000  # entries of a model directory checked by `check_tree`


class PathRefused(ConfigError):
    """A path the policy in force refuses (or a special file): the problem names the field and the rule."""


@dataclass(frozen=True)
class FilePolicy:
    """Where a job's files may be (all resolved): `roots` (read), `own` (the user's directory: the only place it
    may write when set), `denied` (refused unless under `own`), `max_bytes` (largest file), `max_line_bytes`."""

    roots: tuple[Path, ...]
    own: Path | None = None
    denied: tuple[Path, ...] = field(default_factory=tuple)
    max_bytes: int | None = None
    max_line_bytes: int = MAX_LINE_BYTES

    def problem(self, path: Path, write: bool) -> str | None:
        """Why `path` (resolved) is refused, or None."""
        if self.own is not None and _under(path, self.own):
            return None
        if any(_under(path, d) for d in self.denied):
            return "it lies in the server's own files or another user's directory"
        if write and self.own is not None:
            return f"a job writes only under its user's directory {self.own}"
        if not any(_under(path, r) for r in self.roots):
            return f"it lies outside the server's allowed roots ({', '.join(str(r) for r in self.roots)})"
        return None


_POLICY: ContextVar[FilePolicy | None] = ContextVar("plexrl_file_policy", default=None)


@contextlib.contextmanager
def file_policy(policy: FilePolicy | None) -> Iterator[None]:
    """Put `policy` in force in this context (None: none) while the block runs."""
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)


def current_policy() -> FilePolicy | None:
    return _POLICY.get()


def _under(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)


def resolve(text: str | Path) -> Path:
    """THE resolution of a job's path: `~` expanded, absolute, symbolic links followed (nothing is created)."""
    return Path(text).expanduser().resolve()


def check_path(text: str | Path, where: str, *, write: bool = False) -> Path:
    """`text` resolved, after the policy in force (if any) allows it (`PathRefused` otherwise, naming `where`)."""
    policy = _POLICY.get()
    if policy is not None and str(text).startswith("~"):
        raise PathRefused([Problem(where, f"{str(text)[:200]!r}: `~` is not expanded here; give the full path")])
    path = resolve(text)
    if policy is not None:
        why = policy.problem(path, write)
        if why is not None:
            raise PathRefused([Problem(where, f"{str(text)[:200]!r} resolves to {path}: {why}")])
    return path


def open_file(text: str | Path, where: str) -> BinaryIO:
    """A regular file opened for reading, checked on the descriptor opened (no link swap between check and
    open): its real path under the policy (if any), not a FIFO, device or socket (the open does not block), no
    larger than the policy's `max_bytes`."""
    path = check_path(text, where)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise PathRefused([Problem(where, f"{path}: cannot open it ({exc.strerror})")]) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PathRefused([Problem(where, f"{path}: not a regular file (a FIFO, device or socket); name a file")])
        policy = _POLICY.get()
        if policy is not None:
            real = Path(os.readlink(f"/proc/self/fd/{fd}")) if os.path.exists(f"/proc/self/fd/{fd}") else path
            why = policy.problem(real, False)
            if why is not None:
                raise PathRefused([Problem(where, f"{path} (opened as {real}): {why}")])
            if policy.max_bytes is not None and info.st_size > policy.max_bytes:
                raise PathRefused(
                    [Problem(where, f"{path}: {info.st_size} bytes; this server reads files of at most "
                                    f"{policy.max_bytes} bytes (limits.max_data_bytes)")]
                )  # fmt: skip
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def same_file(fh: BinaryIO, identity: tuple[int, int]) -> bool:
    """Whether the open `fh` is the file of `identity` (`(st_dev, st_ino)`, from `identity_of`)."""
    info = os.fstat(fh.fileno())
    return (info.st_dev, info.st_ino) == identity


def identity_of(fh: BinaryIO) -> tuple[int, int]:
    """The identity of an open file: what `same_file` compares when the file is opened again later."""
    info = os.fstat(fh.fileno())
    return info.st_dev, info.st_ino


def check_tree(text: str | Path, where: str) -> Path:
    """A directory a library opens files in by itself (a model directory): the directory resolved and allowed,
    and every entry under it (at most `MAX_TREE_ENTRIES`) a regular file or directory whose real path the policy
    allows (a link leading out, a FIFO or a device: `PathRefused`). Without a policy: resolved only."""
    path = check_path(text, where)
    if _POLICY.get() is None or not path.is_dir():
        return path
    seen = 0
    for base, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            seen += 1
            if seen > MAX_TREE_ENTRIES:
                raise PathRefused([Problem(where, f"{path}: more than {MAX_TREE_ENTRIES} entries; name a model dir")])
            entry = Path(base) / name
            mode = os.stat(entry).st_mode if entry.exists() else 0
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise PathRefused([Problem(where, f"{entry}: not a regular file or directory (or a broken link)")])
            if entry.is_symlink():
                check_path(entry, where)
    return path


def read_lines(fh: BinaryIO, max_line_bytes: int | None = None) -> Iterator[bytes]:
    """The lines of `fh` (with their newline), each at most `max_line_bytes` (default: the policy's, else
    `MAX_LINE_BYTES`); a longer one raises `LineTooLong` after reading that many bytes of it, no more."""
    limit = max_line_bytes
    if limit is None:
        policy = _POLICY.get()
        limit = policy.max_line_bytes if policy is not None else MAX_LINE_BYTES
    number = 0
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line) > limit and not line.endswith(b"\n"):
            raise LineTooLong(number, limit)
        yield line


class LineTooLong(ValueError):
    """A line longer than the bound (`line`: its number from 1)."""

    def __init__(self, line: int, limit: int) -> None:
        self.line, self.limit = line, limit
        super().__init__(f"line {line} is longer than {limit} bytes (limits.max_line_bytes); split the file")


__all__ = [
    "FilePolicy",
    "LineTooLong",
    "PathRefused",
    "check_path",
    "check_tree",
    "current_policy",
    "file_policy",
    "identity_of",
    "open_file",
    "read_lines",
    "resolve",
    "same_file",
]
