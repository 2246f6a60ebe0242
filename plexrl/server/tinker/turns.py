"""A training client's requests in seq-id order (the `Registry`'s `turns`; its lock held by every caller): the SDK
numbers a training client's requests (`seq_id`) and Tinker runs them in that order, so one that comes early waits
for those before it, a repeated one gets the first one's future, a refused one still uses its turn (the SDK
counts it sent), and requests waiting for a seq id that never comes (one refused before its id could be read, or
one the SDK gave up retrying) get their turn after `tinker.turn_wait_s` (`skip_gaps`, from the registry's tick)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from plexrl.server.tinker.decode import Refused
from plexrl.server.tinker.futures import Finish, Futures, replying
from plexrl.server.tinker.records import ModelRecord
from plexrl.sessions.calls import Call, call_bytes

log = logging.getLogger(__name__)

MAX_AHEAD = 1024  # a training request may come at most this many seq ids before its turn


class Turns:
    """See the module docstring: requests passed on to `backend` (the registry's) in order, their futures in
    `futures`; `clock` says since when a gap waits."""

    def __init__(self, futures: Futures, backend: Any, clock: Callable[[], float]) -> None:
        self.futures, self.backend, self.clock = futures, backend, clock

    @contextlib.contextmanager
    def turn(self, m: ModelRecord, seq: Any) -> Iterator[None]:
        """The checks of the owner's training request `seq` (lock held): one that refuses it still uses its turn,
        as the SDK counts it sent (its next request carries the next seq id); but not a refusal the SDK retries
        with the same seq id (429, 5xx: a full disk, a busy server), whose turn waits for the retry."""
        try:
            yield
        except Refused as e:
            if e.retried or not isinstance(seq, int) or isinstance(seq, bool) or m.next_seq is None or seq in m.seen:
                raise
            if seq == m.next_seq:
                m.next_seq += 1
                self.flush(m)
            elif m.next_seq < seq <= m.next_seq + MAX_AHEAD and seq not in m.held:
                m.held[seq] = None  # refused before its turn: its turn is skipped when it comes
            raise

    def flush(self, m: ModelRecord) -> None:
        """Pass on the held requests whose turn has come, skipping the turns of refused ones (lock held); what is
        still held then waits for a missing seq id, since now if it did not already (`skip_gaps`)."""
        while m.next_seq is not None and m.next_seq in m.held:
            held = m.held.pop(m.next_seq)
            if held is not None:
                kind, c, rid, fin = held
                self.backend.call(m.job_id, kind, c, replying(self.futures, rid, fin))
            m.next_seq += 1
        m.gap_since = (self.clock() if m.gap_since is None else m.gap_since) if m.held else None

    def ordered(self, m: ModelRecord, seq: Any, call: Call, finish: Finish) -> dict[str, Any]:
        """Pass a training request on in seq-id order (lock held); its future's answer."""
        if seq is None:
            seq = m.next_seq if m.next_seq is not None else 0
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise Refused(400, "seq_id must be a non-negative integer")
        if m.next_seq is None:
            m.next_seq = seq  # (a model resumed after a restart: its client's numbering goes on)
        if seq in m.seen:
            return {"request_id": m.seen[seq], "model_id": m.model_id}
        if seq in m.held:  # (only a refused request's skipped turn is held without being seen)
            raise Refused(400, f"seq_id {seq} was used by a refused request; send the next one")
        if seq < m.next_seq or seq > m.next_seq + MAX_AHEAD:
            raise Refused(400, f"seq_id {seq} is out of order (the next is {m.next_seq})")
        fut = self.futures.new(m.user, call.kind, nbytes=call_bytes(call), session=m.session_id)
        m.seen[seq] = fut.request_id
        if len(m.seen) > 4 * MAX_AHEAD:
            for old in sorted(m.seen)[: len(m.seen) - 2 * MAX_AHEAD]:
                del m.seen[old]
        m.held[seq] = (call.kind, call, fut.request_id, finish)
        self.flush(m)
        return {"request_id": fut.request_id, "model_id": m.model_id}

    def skip_gaps(self, models: Iterable[ModelRecord], wait_s: float) -> None:
        """The requests of `models` held `wait_s` or more for a seq id that has not come get their turn: the
        missing ids are skipped (one that still comes is out of order)."""
        now = self.clock()
        for m in models:
            if m.gap_since is not None and now - m.gap_since >= wait_s and m.held:
                log.warning("model %s: seq ids %d..%d never came in %.0f s; skipped", m.model_id, m.next_seq,
                            min(m.held) - 1, now - m.gap_since)  # fmt: skip
                m.next_seq, m.gap_since = min(m.held), None  # (a further gap waits its own time)
                self.flush(m)


__all__ = ["MAX_AHEAD", "Turns"]
