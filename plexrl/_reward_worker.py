"""The process one reward term runs in (`python -m plexrl._reward_worker`), started and killed by
`plexrl.reward_workers`. Not imported by PlexRL itself.

Protocol. Requests arrive on stdin as frames (8-byte big-endian length, then a pickle from the parent, which
this process trusts: it started it). Answers go back as JSON lines on a private copy of the original stdout;
the process's own stdout (fd 1) is pointed at stderr first, so a reward that prints cannot corrupt them. The
parent never unpickles anything from here.

1. `{"path": [...], "allowed": [...] | None, "term": {...}}`: set `sys.path`, resolve the term (a built-in by
   name with its parameters checked, or a user's ref through `plexrl.roles.resolve` under the same
   allow-list); answer `{"ready": true}` or `{"error": "..."}` (then exit).
2. `{"rows": [(prompt, response, truth, extra), ...]}`: one answer line per call, in order, as each call
   ends: `{"ok": value}` or `{"error": "Type: message"}`. A batched user reward is one call for all rows;
   every other term is one call per row.
3. End of stdin: exit.

Before each call the soft CPU limit (RLIMIT_CPU) is set to the CPU time used so far plus the term's time
limit plus a second: a call that spins holding the GIL (Python's `re`, native code) is ended by the kernel
even if the parent that should kill it is gone.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import resource
import struct
import sys
from typing import Any


def _read_frame(fd: int) -> Any:
    head = _read_exactly(fd, 8)
    if head is None:
        return None
    body = _read_exactly(fd, struct.unpack(">Q", head)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _answer(out: Any, record: dict[str, Any]) -> None:
    try:
        line = json.dumps(record)
    except (TypeError, ValueError) as exc:
        line = json.dumps({"error": f"TypeError: the reward returned a value that is not a number: {exc}"})
    out.write(line.encode() + b"\n")
    out.flush()


def _cpu_limit(timeout_s: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + timeout_s) + 1
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _resolve(hello: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    """(the function, its keyword parameters, its kind: builtin | batched | row)."""
    sys.path[:] = hello["path"]
    term = hello["term"]
    if term["name"] is not None:
        from plexrl.reward_builtins import BUILTINS, check_params

        return BUILTINS[term["name"]][1], {"p": check_params(term["name"], term["params"])}, "builtin"
    from plexrl.roles import allowed_modules, resolve

    allowed = hello["allowed"]
    if allowed is None:
        fn = resolve(term["ref"], "reward")
    else:
        with allowed_modules(allowed):
            fn = resolve(term["ref"], "reward")
    batched = bool(getattr(fn, "__plexrl_reward_batched__", False))
    return fn, dict(term["params"]), "batched" if batched else "row"


def _call(fn: Any, params: dict[str, Any], kind: str, rows: list[tuple[Any, ...]]) -> Any:
    if kind == "builtin":
        return fn([rows[0][1]], [rows[0][2]], params["p"])[0]
    if kind == "batched":
        return fn(*(list(col) for col in zip(*rows, strict=True)), **params)
    return fn(*rows[0], **params)


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's own prints go to stderr
    sys.stdout = sys.stderr
    hello = _read_frame(0)
    if hello is None:
        return
    try:
        fn, params, kind = _resolve(hello)
    except BaseException as exc:
        _answer(out, {"error": f"{type(exc).__name__}: {exc}"})
        return
    _answer(out, {"ready": True})
    timeout_s = float(hello["term"]["timeout_s"])
    while True:
        request = _read_frame(0)
        if request is None:
            return
        rows = request["rows"]
        calls = [rows] if kind == "batched" else [[row] for row in rows]
        for call in calls:
            _cpu_limit(timeout_s)
            try:
                value = _call(fn, params, kind, call)
            except BaseException as exc:  # the reward's failure is an answer, never this process's end
                _answer(out, {"error": f"{type(exc).__name__}: {exc}"})
                continue
            _answer(out, {"ok": value})


if __name__ == "__main__":
    main()
