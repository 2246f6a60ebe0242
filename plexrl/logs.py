"""Repeated log lines, rate-limited: `RepeatFilter` lets through at most `burst` records of one kind (logger,
level and message template, before its arguments are filled in) per `window_s` seconds, drops the rest, and
says how many it dropped on the next record of that kind that gets through. A flood (a warning per failed
reward call, a traceback per refused connection or per client that hangs up) costs a few lines a minute,
not hundreds of megabytes of stderr; the first lines of each kind, with their tracebacks, still show.

`limit_repeats(*names)` puts one filter on the named loggers (records logged there directly) and on every
handler of the root logger (records of any logger that reach it). What this module does NOT do: choose
levels or handlers (the command line does), or merge lines of different templates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

BURST = 5  # records of one kind let through per window
WINDOW_S = 60.0
MAX_KINDS = 4096  # kinds remembered (the least recently seen is forgotten)


class RepeatFilter(logging.Filter):
    """See the module docstring. Thread-safe; `clock` is injectable (tests)."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._lock = threading.Lock()
        self._kinds: OrderedDict[tuple[str, int, str], list[float]] = OrderedDict()  # -> [start, passed, dropped]
        self.dropped = 0  # records dropped in all (tests, and a figure to report)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_plexrl_seen", None) is self:  # (one verdict per record: filters on loggers and
            return True  # handlers both see it)
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            state = self._kinds.pop(key, None)
            if state is None or now - state[0] >= self.window_s:
                before = 0 if state is None else int(state[2])
                state = [now, 1.0, 0.0]
                if before:
                    record.msg = f"{record.msg} [{before} similar line(s) suppressed in the last window]"
            elif state[1] < self.burst:
                state[1] += 1
            else:
                state[2] += 1
                self.dropped += 1
                self._kinds[key] = state
                return False
            self._kinds[key] = state
            while len(self._kinds) > MAX_KINDS:
                self._kinds.popitem(last=False)
        record._plexrl_seen = self
        return True


REPEATS = RepeatFilter()  # the process's one filter (a record is judged once, wherever it meets it)


def limit_repeats(*names: str) -> RepeatFilter:
    """`REPEATS` on the loggers `names` and on every handler of the root logger (each once; a handler added
    later gets it at the next call)."""
    f = REPEATS
    for target in [*(logging.getLogger(n) for n in names), *logging.getLogger().handlers]:
        if f not in target.filters:
            target.addFilter(f)
    return f


__all__ = ["REPEATS", "RepeatFilter", "limit_repeats"]
