"""Partial rollouts that move the long tail off the pool: a rollout on the job's pool runs until all but a
`share` of the step's sequences have ended, then the unfinished ones move (prompt and tokens so far
re-prefilled) to `accelerators` of the job's own, and the pool is free for other jobs' nodes. The pool's
part of the rollout ("rollout") and the tail ("tail", on the job's own accelerators) are two nodes.

Seer (Qiu et al., 2025) reports the last ~10% of requests taking up to half of a synchronous rollout's time;
this is the mechanism that figure invites. The cut is global (the instant the `1 - share` quantile of end
times is reached over all replicas); each replica's timeline is the continuous-batching model of
`plexrl.sim.costs.Decoder` with each sequence's start and end step recorded.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from dataclasses import dataclass

from plexrl.sim.config import Accelerator, Efficiency, Model, Workload
from plexrl.sim.costs import Decoder, DoesNotFit, draw_lengths, mean_context, reference_rate


@dataclass(frozen=True, slots=True)
class Timeline:
    spans: list[tuple[int, int]]  # per sequence: (start step, end step) on its replica
    bounds: list[int]  # token-step boundaries between which a fixed number of sequences run
    times: list[float]  # seconds at each boundary
    per: list[float]  # seconds per token step in each interval

    def time_at(self, step: int) -> float:
        i = min(max(bisect.bisect_right(self.bounds, step) - 1, 0), len(self.per) - 1)
        return self.times[i] + (step - self.bounds[i]) * self.per[i]

    def step_at(self, t: float) -> int:
        i = min(max(bisect.bisect_right(self.times, t) - 1, 0), len(self.per) - 1)
        return min(self.bounds[i] + int((t - self.times[i]) / self.per[i]), self.bounds[-1])


def timeline(dec: Decoder, lengths: list[int]) -> Timeline:
    """One replica's decode of `lengths` (continuous batching), as `Decoder.run` models it."""
    slots = min(dec.slots, len(lengths))
    heap = [(0, s) for s in range(slots)]
    spans = []
    for n in lengths:
        free, slot = heapq.heappop(heap)
        spans.append((free, free + n))
        heapq.heappush(heap, (free + n, slot))
    bounds, times, per, prev = [0], [0.0], [], 0
    for k, end in enumerate(sorted(f for f, _ in heap)):
        if end > prev:
            dt = dec.step_seconds(slots - k)
            times.append(times[-1] + (end - prev) * dt)
            bounds.append(end)
            per.append(dt)
            prev = end
    return Timeline(spans, bounds, times, per)


def _prefill(acc: Accelerator, model: Model, eff: Efficiency, tp: int, tokens: float) -> float:
    return 2 * model.active_b * 1e9 * tokens / tp / (acc.peak_tflops * 1e12 * eff.prefill_mfu)


@dataclass(frozen=True, slots=True)
class TailSample:
    bulk: float  # seconds on the pool
    tail: float  # seconds on the job's own tail accelerators
    tokens: int
    prompt_tokens: int
    efficiency: float  # of the pool's part, on the scenario's one scale


def tail_samples(
    acc: Accelerator, model: Model, eff: Efficiency, work: Workload, accelerators: int, tp: int, k: int, seed: int,
    reserved: float, share: float, tail_accelerators: int,
) -> list[TailSample]:  # fmt: skip
    """`k` seeded rollouts (the same draws as `rollout_samples`) cut when all but `share` have ended."""
    if tail_accelerators < tp:
        raise DoesNotFit(f"{tail_accelerators} tail accelerators cannot hold one replica of TP{tp}")
    rng = random.Random(f"rollout/{seed}/{model.name}/{accelerators}/{tp}")
    dec = Decoder(acc, model, eff, tp, mean_context(work, rng), reserved)
    ref = reference_rate(acc, model, eff, work)
    replicas, tail_replicas = accelerators // tp, tail_accelerators // tp
    n = work.prompts * work.samples
    out = []
    for _ in range(k):
        lengths = draw_lengths(work.response, n, rng)
        rng.shuffle(lengths)
        lines = [timeline(dec, lengths[r::replicas]) for r in range(min(replicas, n))]
        ends = sorted(line.time_at(e) for line in lines for _, e in line.spans)
        cut = ends[max(0, math.ceil((1 - share) * n) - 1)]
        moved: list[tuple[int, int]] = []  # (tokens done, tokens left) of each moved sequence
        for line in lines:
            s_cut = line.step_at(cut)
            moved += [(max(0, s_cut - a), b - max(a, s_cut)) for a, b in line.spans if b > s_cut]
        bulk = cut + _prefill(acc, model, eff, tp, work.prompt_tokens * math.ceil(n / replicas))
        tail = 0.0
        if moved:
            left = sum(r for _, r in moved)
            ctx = sum(r * (work.prompt_tokens + d + r / 2) for d, r in moved) / max(left, 1)
            tdec = Decoder(acc, model, eff, tp, ctx)
            moved.sort(key=lambda m: -m[1])
            for r in range(min(tail_replicas, len(moved))):
                mine = moved[r::tail_replicas]
                refill = sum(work.prompt_tokens + d for d, _ in mine)
                tail = max(tail, tdec.run([x for _, x in mine], 0) + _prefill(acc, model, eff, tp, refill))
        tokens = sum(lengths)
        done_on_pool = tokens - sum(r for _, r in moved)
        out.append(TailSample(bulk, tail, tokens, work.prompt_tokens * n, done_on_pool / (accelerators * bulk * ref)))
    return out
