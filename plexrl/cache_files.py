"""Cache files written safely by many threads and processes at once: a lock per key, a unique temporary name.

Every cache of PlexRL (Arrow copies and row indexes of data files, the filter's kept rows, pretrained
conversions, built and warm-started models) is written the same way:

    with key_lock(target):                # one writer per key: threads of this process AND other processes
        if not target.exists():           # another writer may have finished while this one waited
            write_atomic(target, write)   # a unique temporary file beside it, renamed over it last

`key_lock(path)` holds an in-process lock for the key (a thread waits for another thread) and an exclusive
`flock` on `.<name>.lock` beside it (a process waits for another process; the kernel drops it when a holder
dies). `write_atomic(path, write)` has `write(tmp)` fill a fresh temporary file (`tempfile.mkstemp` in the
same directory: never shared by two writers, whatever their process or thread), then renames it over
`path` in one step; on any error the temporary file is removed and `path` is left as it was. A reader thus
sees either no file or a whole one.

Why both: the server prepares jobs on threads of one process (a temporary name by process id alone let two
threads write the same file and one rename fail), and two servers or a CLI run may share a cache
directory. What it does NOT do: expire or clean caches, or lock readers (they need no lock: files appear
whole, and a replaced file stays readable through a handle opened before).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def lock_file(path: Path) -> Path:
    """The lock file of the key `path`: `.<name>.lock` beside it."""
    return path.parent / f".{path.name}.lock"


@contextlib.contextmanager
def key_lock(path: Path, poll: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold the lock of the key `path` (its directory is created) against other threads and processes.
    `poll`, when given, is called about every 0.1 s while waiting (it may raise to give up: a cancel)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = str(path.resolve())
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(key, threading.Lock())
    while not lock.acquire(timeout=0.1):
        if poll is not None:
            poll()
    try:
        with open(lock_file(path), "a") as fh:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | (fcntl.LOCK_NB if poll is not None else 0))
                    break
                except BlockingIOError:
                    assert poll is not None
                    poll()
                    time.sleep(0.1)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)
    finally:
        lock.release()


def write_atomic(path: Path, write: Callable[[Path], object]) -> Path:
    """`write(tmp)` into a fresh temporary file beside `path`, then renamed over `path` (see the module
    docstring); returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def temp_dir_beside(path: Path) -> Path:
    """A fresh, unique temporary directory beside `path` (to fill, then rename over it under `key_lock`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))


__all__ = ["key_lock", "lock_file", "temp_dir_beside", "write_atomic"]
