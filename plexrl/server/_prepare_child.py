"""The child process of `plexrl.server.preparation` (`python -m plexrl.server._prepare_child`): sets its own
address-space limit (`PLEXRL_PREPARE_MEMORY` bytes; 0: none), reads one pickled request on stdin (`entry`,
`kwargs` of `entries.prepare_entry`, the parent's `sys.path`), prepares the job (filling the caches the server
process then reads) and writes one JSON line on the descriptor `PLEXRL_ANSWER_FD`: `{"ok": true}`,
`{"problems": [[where, message], ...]}` or `{"error": "Type: message"}`. Its stdout goes to stderr (what the
preparation prints is not the answer)."""

from __future__ import annotations

import json
import os
import pickle
import resource
import sys


def main() -> None:
    answer = os.fdopen(int(os.environ["PLEXRL_ANSWER_FD"]), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    memory = int(os.environ.get("PLEXRL_PREPARE_MEMORY", "0"))
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        request = pickle.loads(sys.stdin.buffer.read())
        sys.path[:] = [p for p in request["path"] if isinstance(p, str)]
        from plexrl.errors import ConfigError
        from plexrl.server.entries import prepare_entry

        try:
            prepare_entry(request["entry"], **request["kwargs"])
        except ConfigError as exc:
            out: dict[str, object] = {"problems": [[p.where, p.message] for p in exc.problems]}
        else:
            out = {"ok": True}
    except MemoryError:
        out = {"error": "MemoryError"}
    except BaseException as exc:
        out = {"error": f"{type(exc).__name__}: {exc}"}
    answer.write(json.dumps(out) + "\n")
    answer.flush()


if __name__ == "__main__":
    main()
