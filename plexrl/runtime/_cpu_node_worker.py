"""The worker process of `plexrl.runtime.cpu_nodes` (`python -m plexrl.runtime._cpu_node_worker`): reads
length-prefixed pickled messages on stdin and answers on stdout, one at a time:

- `("path", entries)` (first): the caller's `sys.path`, so that its modules import here as there;
- `("spec", key, spec)`: keep the job's spec under `key`; answers `("ready", key)` (or `("error", text)`);
- `("forget", job_id)`: drop the specs of that job; no answer;
- `("run", key, iteration, node, inputs)`: run the CPU node (`services.service.run_cpu_node`, which returns the
  node's own errors in its report) and answer its pickled `NodeResult`.

It exits at the end of its input. The parent kills its process group when a node passes its time limit. What
the node prints goes to stderr (its stdout is the answer channel's, taken over before any node runs).
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
import time
from typing import Any, BinaryIO


def _read(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack(">Q", head)
    return pickle.loads(stream.read(size))


def main() -> None:
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")  # the answer channel: a node's prints go elsewhere
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    import cloudpickle

    from plexrl.services.service import run_cpu_node

    requests = sys.stdin.buffer
    specs: dict[Any, Any] = {}

    def answer(obj: Any) -> None:
        body = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        answers.write(struct.pack(">Q", len(body)) + body)
        answers.flush()

    while True:
        message = _read(requests)
        if message is None:
            return
        kind = message[0]
        if kind == "path":
            sys.path[:] = [p for p in message[1] if isinstance(p, str)]
        elif kind == "spec":
            specs[message[1]] = message[2]
            answer(("ready", message[1]))
        elif kind == "forget":
            for key in [k for k in specs if k[0] == message[1]]:
                del specs[key]
        elif kind == "run":
            _, key, iteration, node, inputs = message
            answer(run_cpu_node(specs[key], iteration, node, inputs, time.time))


if __name__ == "__main__":
    main()
