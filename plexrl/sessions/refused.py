"""`CallRefused`: a session call that its service will not carry out (a user error found there); and
`failed_text`, what a client is told of a call that failed on its service. Below both the session's engine
(`plexrl/sessions/engine.py`) and its sampling (`plexrl/sessions/sampling.py`), which use them."""

from __future__ import annotations

import re

# an absolute path on the server (not a `tinker://` path, not a URL): what a failure's text must not show
SERVER_PATH = re.compile(r"(?<![\w:/.])/(?:[\w.@+-]+/)+[\w.@+-]*")


class CallRefused(Exception):
    """A call the service will not carry out (a user error): it changes nothing and comes back in the reply."""


def failed_text(kind: str, exc: BaseException) -> str:
    """A client's answer for a `kind` call that failed on its service: the error's type and text, with the
    server's own paths (which name its directories and other users' ids) left out.

    >>> failed_text("sample", OSError("cannot read /srv/runs/sessions/s1-train-0/snapshots/3.safetensors"))
    'the sample call failed on its service: OSError: cannot read <a server path>'
    >>> failed_text("forward", ValueError("bad tinker://s1:train:0/weights/w"))
    'the forward call failed on its service: ValueError: bad tinker://s1:train:0/weights/w'
    """
    return (
        f"the {kind} call failed on its service: {type(exc).__name__}: {SERVER_PATH.sub('<a server path>', str(exc))}"
    )


__all__ = ["SERVER_PATH", "CallRefused", "failed_text"]
