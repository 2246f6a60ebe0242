"""`StateManager`: where each job's state lives on ONE service, and which moves keep the budgets.

Pure (docs invariant 1): it never copies a byte; it answers "which moves make job J runnable" and the
service carries the moves out in the order given. Tiers, fastest first: `device` (runnable), `host` (CPU
memory), `disk` (safetensors files). Each tier has a byte budget (None = unlimited). A job's state (policy
weights + optimizer state + reference weights when its pipeline uses KL) lives in exactly one tier.

Victims are chosen by predicted next use: the job whose next service node is furthest away leaves first
(ties: job id); a pinned job (the one about to run) is never a victim. An evicted state goes to the fastest
lower tier with room; when host is full, host residents needed later than the victim spill to disk to make
room, otherwise the victim itself goes to disk. So the state needed last sits in the slowest tier.
A shared generation engine (vLLM: one weight copy plus its KV cache) is a fixed resident of the device tier
while one of its jobs is placed here: admitting the first job of an engine reserves it, releasing the last
frees it. Not done here: timing, checksums, actually moving tensors (the service does that).

`exclusive` (the state-movement mode of exclusive time-slicing, the llm-d / OpenRL design): one job's state
on device at a time. Making a job resident first moves every other job's state off device, whole, whether
or not the budget could hold them side by side (a hand-over snapshots the previous holder's state to host),
and nothing is ever prefetched. Shared engines stay (they are the service's, not a job's).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Tier = Literal["device", "host", "disk"]
TIERS: tuple[Tier, ...] = ("device", "host", "disk")


class NoRoom(RuntimeError):
    """The budgets cannot hold the states asked for (a config error, caught at validation)."""


@dataclass(frozen=True, slots=True)
class Move:
    """Move `job_id`'s state (`nbytes`) from tier `src` to tier `dst` on the service."""

    job_id: str
    src: Tier
    dst: Tier
    nbytes: int


@dataclass(slots=True)
class StateManager:
    service_id: str
    budgets: dict[Tier, int | None] = field(default_factory=lambda: {t: None for t in TIERS})
    where: dict[str, Tier] = field(default_factory=dict)
    size: dict[str, int] = field(default_factory=dict)
    # shared generation engines resident on device (vLLM: one weight copy + KV cache), by key, and the key
    # each job uses; an engine stays while one of its jobs is placed here and is never evicted
    engines: dict[str, int] = field(default_factory=dict)
    engine_of: dict[str, str] = field(default_factory=dict)
    exclusive: bool = False  # one job's state on device at a time; no prefetch (see the module docstring)
    copy_engine: bool = False  # moves run beside compute (a GPU's copy stream), not on its cores (`prefetch`)
    # bytes used per tier, recomputed after any change (every write below goes through `_changed`)
    _used: dict[Tier, int] = field(default_factory=dict, repr=False, compare=False)

    # -- queries --------------------------------------------------------------------------------------
    def used(self, tier: Tier) -> int:
        used = self._used.get(tier)
        if used is None:
            used = sum(self.size[j] for j, t in self.where.items() if t == tier)
            used += sum(self.engines.values()) if tier == "device" else 0
            self._used[tier] = used
        return used

    def _put(self, job_id: str, tier: Tier) -> None:
        self.where[job_id] = tier
        self._used.clear()

    def _restore(self, snapshot: dict[str, Tier]) -> None:
        self.where = snapshot
        self._used.clear()

    def _new_engine_bytes(self, engine: tuple[str, int] | None) -> int:
        """Device bytes a job using `engine` would add by bringing a new engine here (0 if it is here)."""
        return 0 if engine is None or engine[0] in self.engines else engine[1]

    def free(self, tier: Tier) -> float:
        budget = self.budgets.get(tier)
        return math.inf if budget is None else budget - self.used(tier)

    def capacity(self) -> float:
        total = 0.0
        for tier in TIERS:
            budget = self.budgets.get(tier)
            total += math.inf if budget is None else budget
        return total

    def can_ever_run(self, nbytes: int, engine: tuple[str, int] | None = None) -> bool:
        """A state of `nbytes` fits on device once every other state is moved away (engines stay)."""
        budget = self.budgets.get("device")
        reserved = sum(self.engines.values()) + self._new_engine_bytes(engine)
        return budget is None or nbytes + reserved <= budget

    def fits(self, nbytes: int, engine: tuple[str, int] | None = None) -> bool:
        """A new state of `nbytes` (using `engine`) can be admitted now: its engine has room on device, the
        state fits in some tier without moving others, and a new engine leaves every placed state room to run
        on device beside all the engines."""
        extra = self._new_engine_bytes(engine)
        if not self.can_ever_run(nbytes, engine) or self.free("device") < extra:
            return False
        budget = self.budgets.get("device")
        largest = max(self.size.values(), default=0)
        if extra and budget is not None and largest + sum(self.engines.values()) + extra > budget:
            return False  # a new engine must leave every placed job room to run beside the engines
        return any(self.free(t) - (extra if t == "device" else 0) >= nbytes for t in self._admit_tiers())

    def _admit_tiers(self) -> tuple[Tier, ...]:
        """The tiers a new state may start in: any, or below device in the `exclusive` mode while another
        state is there."""
        taken = self.exclusive and any(t == "device" for t in self.where.values())
        return TIERS[1:] if taken else TIERS

    def on_device(self, job_id: str) -> bool:
        return self.where.get(job_id) == "device"

    # -- decisions ------------------------------------------------------------------------------------
    def admit(self, job_id: str, nbytes: int, engine: tuple[str, int] | None = None) -> Tier | None:
        """Record a new job's state in the fastest tier with room (the service materialises it there), and
        its engine on device when it is the first job here to use it."""
        if job_id in self.where:
            raise ValueError(f"job {job_id!r} already has state on {self.service_id}")
        if not self.fits(nbytes, engine):
            return None
        if engine is not None:
            self.engines.setdefault(engine[0], engine[1])
            self._used.clear()
            self.engine_of[job_id] = engine[0]
        for tier in self._admit_tiers():
            if self.free(tier) >= nbytes:
                self.size[job_id] = nbytes
                self._put(job_id, tier)
                return tier
        raise AssertionError("fits() and admit() disagree")  # pragma: no cover

    def measured(self, job_id: str, nbytes: int) -> bool:
        """Replace the job's estimated state size with a measured one. Applied when the state's current tier
        still holds it (a measured state larger than its tier's room keeps its old size until it moves);
        returns whether the size changed."""
        tier = self.where.get(job_id)
        if tier is None or nbytes <= 0:
            return False
        if nbytes == self.size[job_id]:
            return False
        if nbytes > self.size[job_id] and self.free(tier) < nbytes - self.size[job_id]:
            return False
        self.size[job_id] = nbytes
        self._used.clear()
        return True

    def release(self, job_id: str) -> None:
        self.where.pop(job_id, None)
        self.size.pop(job_id, None)
        self._used.clear()
        key = self.engine_of.pop(job_id, None)
        if key is not None and key not in self.engine_of.values():
            del self.engines[key]  # its last job left: the service shuts the engine down

    def make_resident(self, job_id: str, next_use: Mapping[str, float], pinned: set[str]) -> list[Move]:
        """Moves that put `job_id` on device (evicting by next use); [] when it is there already.
        Raises `NoRoom` when the jobs in `pinned` leave too little device memory."""
        src = self.where[job_id]
        if src == "device":
            return []
        snapshot = dict(self.where)
        keep = pinned | {job_id}
        try:
            moves: list[Move] = []
            if self.exclusive:  # the hand-over: every other state off device, whole, latest next use first
                others = sorted((j for j, t in self.where.items() if t == "device" and j not in keep),
                                key=lambda j: (-next_use.get(j, math.inf), j))  # fmt: skip
                for other in others:
                    moves += self._demote(other, TIERS[1:], next_use, keep)
            moves += self._room_on("device", self.size[job_id], next_use, keep, None)
        except NoRoom:
            self._restore(snapshot)
            raise
        self._put(job_id, "device")
        moves.append(Move(job_id, src, "device", self.size[job_id]))
        return moves

    def prefetch(self, job_id: str, next_use: Mapping[str, float], pinned: set[str]) -> list[Move]:
        """Like `make_resident`, but only evicting jobs needed later than `job_id`; [] if that is not enough, and
        always [] in the `exclusive` mode (no prefetch). Without a `copy_engine` (moves share the compute's
        cores, so a background copy is not free), also only jobs needed later than every pinned job on device
        (the node running or sent: when `job_id`'s turn comes that job's node has ended, and if it is needed
        later than a victim, evicting it then moves fewer bytes than evicting the victim now). With one, a copy
        beside compute costs no service time, and prefetching now hides what would block later."""
        if self.exclusive or self.where.get(job_id, "device") == "device":
            return []
        horizon = next_use.get(job_id, math.inf)
        for other in () if self.copy_engine else pinned:
            if other != job_id and self.where.get(other) == "device":
                horizon = max(horizon, next_use.get(other, 0.0))
        snapshot = dict(self.where)
        try:
            moves = self._room_on("device", self.size[job_id], next_use, pinned | {job_id}, horizon)
        except NoRoom:
            self._restore(snapshot)
            return []
        moves.append(Move(job_id, self.where[job_id], "device", self.size[job_id]))
        self._put(job_id, "device")
        return moves

    def _room_on(
        self, tier: Tier, need: int, next_use: Mapping[str, float], keep: set[str], horizon: float | None
    ) -> list[Move]:
        """Demote residents of `tier` (latest next use first) until `need` bytes are free there."""
        moves: list[Move] = []
        if self.free(tier) >= need:
            return moves
        lower = TIERS[TIERS.index(tier) + 1 :]
        victims = sorted(
            (j for j, t in self.where.items() if t == tier and j not in keep),
            key=lambda j: (-next_use.get(j, math.inf), j),
        )
        for victim in victims:
            if self.free(tier) >= need:
                break
            if horizon is not None and next_use.get(victim, math.inf) <= horizon:
                raise NoRoom(f"making room would evict {victim}, which is needed sooner")
            moves += self._demote(victim, lower, next_use, keep)
        if self.free(tier) < need:
            raise NoRoom(
                f"service {self.service_id}: {need} bytes do not fit in tier {tier} "
                f"(budget {self.budgets.get(tier)}, pinned jobs {sorted(keep)})"
            )
        return moves

    def _demote(
        self, victim: str, lower: tuple[Tier, ...], next_use: Mapping[str, float], keep: set[str]
    ) -> list[Move]:
        """Move `victim` to the fastest lower tier that has room, or can make room by pushing down its own
        residents that are needed later than the victim (so the job needed last ends up slowest)."""
        nbytes, src = self.size[victim], self.where[victim]
        horizon = next_use.get(victim, math.inf)
        for i, tier in enumerate(lower):
            if self.free(tier) >= nbytes:
                self._put(victim, tier)
                return [Move(victim, src, tier, nbytes)]
            if i == len(lower) - 1:
                break
            snapshot = dict(self.where)
            try:
                moves = self._room_on(tier, nbytes, next_use, keep | {victim}, horizon)
            except NoRoom:
                self._restore(snapshot)
                continue
            self._put(victim, tier)
            return [*moves, Move(victim, src, tier, nbytes)]
        raise NoRoom(f"service {self.service_id}: no tier below {src} has room for {victim} ({nbytes} bytes)")

    # -- checks ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        for tier in TIERS:
            if self.free(tier) < 0:
                raise AssertionError(
                    f"service {self.service_id}: tier {tier} over budget ({self.used(tier)} > {self.budgets[tier]})"
                )
        if self.exclusive and sum(t == "device" for t in self.where.values()) > 1:
            raise AssertionError(f"service {self.service_id}: exclusive, but {self.where} has several on device")
        if set(self.where) != set(self.size):
            raise AssertionError(f"service {self.service_id}: state records out of step")
        if set(self.engine_of.values()) != set(self.engines) or not set(self.engine_of) <= set(self.where):
            raise AssertionError(f"service {self.service_id}: engines {self.engines} out of step with their jobs")
