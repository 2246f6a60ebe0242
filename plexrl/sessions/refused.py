"""`CallRefused`: a session call that its service will not carry out (a user error found there). Below both the
session's engine (`plexrl/sessions/engine.py`) and its sampling (`plexrl/sessions/sampling.py`), which raise it."""

from __future__ import annotations


class CallRefused(Exception):
    """A call the service will not carry out (a user error): it changes nothing and comes back in the reply."""


__all__ = ["CallRefused"]
