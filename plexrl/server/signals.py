"""SIGTERM (what `kill`, systemd and batch schedulers send) handled as a stop, not as a sudden death.

- `plexrl run`: `sigterm_as_interrupt()` makes the first SIGTERM raise `Terminated`, a `KeyboardInterrupt`, in
  the main thread, so the run ends exactly as on Ctrl-C: the runner closes every open job as `cancelled`, the
  MLflow hook ends each job's run KILLED, the cluster run is closed. Later SIGTERMs are ignored so that this
  clean-up is not cut short (SIGKILL still ends the process).
- `plexrl serve`: `stop_event()` returns an event that SIGTERM and SIGINT set; the main thread waits on it and
  then stops the server gracefully (see `plexrl.server.api.RunningServer.stop`).

Both install handlers, so both must be called from the main thread.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """SIGTERM received: stop as on Ctrl-C."""


def sigterm_as_interrupt() -> None:
    """Install the `plexrl run` SIGTERM handler (see the module docstring)."""
    fired = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:
            log.warning("SIGTERM again: still closing the jobs' runs; send SIGKILL to end at once")
            return
        fired = True
        raise Terminated("SIGTERM")

    signal.signal(signal.SIGTERM, handler)


def stop_event() -> threading.Event:
    """An event set by SIGTERM or SIGINT (installed now; main thread only)."""
    event = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("%s: stopping gracefully", signal.Signals(signum).name)
        event.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return event


__all__ = ["Terminated", "sigterm_as_interrupt", "stop_event"]
