"""SIGTERM (what `kill`, systemd and batch schedulers send) handled as a stop, not as a sudden death.

- `plexrl run`: `sigterm_stops_runs()` makes the first SIGTERM ask every runner of this process to stop
  (`Runner.stop`): at the top of its next turn (after the node that is running, if any) it closes every open
  job as `cancelled`, the MLflow hook ends each job's run KILLED, and `run` returns normally, so that the
  clean-up never runs with an exception flying through an MLflow write (an exception raised at an arbitrary
  point, as Ctrl-C does, can leave the MLflow sqlite store locked and the runs RUNNING). With no runner
  running (during a warm start), or at a second SIGTERM, it raises `Terminated` (a `KeyboardInterrupt`):
  the Ctrl-C path. `sigterm_received()` tells the CLI to exit with 130.
- `plexrl serve`: `stop_event()` returns an event that SIGTERM and SIGINT set; the main thread waits on it and
  then stops the server gracefully (see `plexrl.server.api.RunningServer.stop`).

Both install handlers, so both must be called from the main thread. The handler never takes a lock itself:
it may interrupt the main thread while the runner holds one, so it stops runners from a new thread.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

_received = threading.Event()


class Terminated(KeyboardInterrupt):
    """SIGTERM received: stop as on Ctrl-C."""


def sigterm_received() -> bool:
    """Whether this process got SIGTERM since `sigterm_stops_runs` was installed."""
    return _received.is_set()


def sigterm_stops_runs() -> None:
    """Install the `plexrl run` SIGTERM handler (see the module docstring)."""
    from plexrl.runtime.runner import running_runners

    _received.clear()

    def handler(signum: int, frame: FrameType | None) -> None:
        runners = running_runners()
        if _received.is_set() or not runners:
            _received.set()
            raise Terminated("SIGTERM")
        _received.set()
        log.warning("SIGTERM: stopping after the running node; send SIGTERM again to stop at once")
        for runner in runners:
            threading.Thread(target=runner.stop, args=("stopped by SIGTERM",), daemon=True).start()

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


__all__ = ["Terminated", "sigterm_received", "sigterm_stops_runs", "stop_event"]
