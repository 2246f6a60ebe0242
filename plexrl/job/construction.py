"""THE process-wide lock around building or loading a torch / transformers model.

transformers' model init patches process-global state (the `torch.nn.init` functions, the init-empty-weights
/ meta-device context, the default dtype) and restores it afterwards; two constructions overlapping in threads
restore each other's patches and leave the process building meta tensors for good ("Cannot copy out of meta
tensor"). Every construction in a process takes `model_construction()`: a job's model build and warm start
(`plexrl.job.models`), a pretrained model's conversion (`plexrl.job.pretrained`), and the in-process
executor's loads and service nodes (`plexrl.runtime.inline`). It is held for the construction only, never for
a warm start's training steps. A leaf: it imports nothing of plexrl.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_MODEL_LOCK = threading.RLock()  # re-entrant: a construction may nest another


@contextmanager
def model_construction() -> Iterator[None]:
    """Hold THE process-wide model-construction lock (see the module docstring) while building or loading a
    torch / transformers model. Re-entrant."""
    with _MODEL_LOCK:
        yield


__all__ = ["model_construction"]
