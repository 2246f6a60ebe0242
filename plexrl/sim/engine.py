"""Several jobs' rollouts in ONE engine on their pool (deployment kind `plexrl-engine`): the `jobs_per_pool`
jobs of a pool decode in the same continuous batches, so another job's sequences fill the slots a job's long
tail leaves empty; their trainings time-slice the pool. Multi-LoRA jobs over one base (a LoRA scenario) are
the case this is for: the base is resident once and read once per decode step for every job's sequences
(each job's adapter applied unmerged, at `lora.decode_overhead` extra per step); without LoRA every job's
rollout weights must sit on the pool at once, and a decode step runs one model after the other.

This is an ENGINE-LEVEL model, not the planner: a planner service runs one node at a time, and here the
rollouts of a pool's jobs run at once. Within one pool, per rollout replica of `tp` accelerators:
- a job's step starts with its batch (the step's responses, shuffled and dealt round-robin to the replicas,
  prefilled on arrival) joining the replica's queue; sequences enter free slots first come first served
  (vLLM's scheduler), one KV pool per replica (LoRA) or a static 1/k share of it per job (k models);
- every decode step advances every running sequence by one token and takes `Decoder.step_seconds` of the
  running count (LoRA: all jobs together, x (1 + decode_overhead); k models: the sum over the jobs running);
- a job's rollout ends when its last sequence ends on every replica; its verification runs on the CPU pool;
  then it queues for the pool's training, first come first served. A training pauses every replica (their
  in-flight KV cache goes to host and back, `host_gbps`), moves the job's training state in and out (LoRA:
  the adapter and its moments only; otherwise the whole state, as colocated offloaded does), and hands the
  new weights to the rollout engine on the same accelerators (`sync_fixed_s`); two `switch_fixed_s`.
  Then the job's next step arrives (on-policy: the rollout of step i+1 starts after the training of step i).

The scenario's pools are identical: one pool is simulated and its accounting counted `services` times (with
a job count that is not a multiple of `jobs_per_pool`, the last pool is charged as a full one: conservative).
Output: a `DeploymentResult` like the planner's rows, plus the share of decode time in which two or more
jobs' rollouts were in flight together (in its `tail_overlap` field: what the sharing bought).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from plexrl.sim.config import GB, Accelerator, Deployment, Scenario
from plexrl.sim.costs import (
    Decoder,
    DoesNotFit,
    adapter_bytes,
    check_host,
    draw_lengths,
    host_bytes,
    lognormal_draws,
    mean_context,
    reference_rate,
    train_seconds,
    train_state_bytes,
)
from plexrl.sim.deploy import DeploymentResult, pool_layout, scenario_jobs

EPS = 1e-7  # token steps: a sequence due at s <= now + EPS has ended


@dataclass(slots=True)
class _Replica:
    """One rollout replica: a token-step clock `s` at wall time `t` (later than now while paused)."""

    dec: Decoder
    slots: dict[int, int]  # job -> slots it may hold (one shared pool: every job maps to all of them)
    shared: bool  # one model (LoRA base) for every job's sequences
    overhead: float
    s: float = 0.0
    t: float = 0.0
    running: list[tuple[float, int]] = field(default_factory=list)  # heap of (end step, job)
    count: dict[int, int] = field(default_factory=dict)  # job -> running sequences
    queue: dict[int, deque[int]] = field(default_factory=dict)  # k models: job -> its queued lengths, FIFO
    order: deque[tuple[int, int]] = field(default_factory=deque)  # shared pool: (job, length) FIFO
    version: int = 0

    def step(self) -> float:
        """Seconds of one decode step with the sequences running now."""
        if self.shared:
            return self.dec.step_seconds(len(self.running)) * (1 + self.overhead)
        return sum(self.dec.step_seconds(n) for n in self.count.values() if n)

    def advance(self, now: float) -> None:
        if now > self.t and self.running:
            self.s += (now - self.t) / self.step()
        self.t = max(self.t, now)

    def next_end(self) -> float:
        if not self.running:
            return math.inf
        return self.t + max(0.0, self.running[0][0] - self.s) * self.step()

    def admit(self) -> None:
        if self.shared:
            while self.order and len(self.running) < self.dec.slots:
                job, n = self.order.popleft()
                heapq.heappush(self.running, (self.s + n, job))
                self.count[job] = self.count.get(job, 0) + 1
            return
        for job, q in self.queue.items():
            while q and self.count.get(job, 0) < self.slots[job]:
                heapq.heappush(self.running, (self.s + q.popleft(), job))
                self.count[job] = self.count.get(job, 0) + 1

    def enqueue(self, job: int, lengths: list[int]) -> None:
        if self.shared:
            self.order.extend((job, n) for n in lengths)
        else:
            self.queue.setdefault(job, deque()).extend(lengths)


@dataclass(slots=True)
class EngineRun:
    """One pool's run: wall times (s) and what its accelerators did."""

    makespan: float
    jct: list[float]  # per job of the pool
    train: float  # pool seconds training (switches included)
    switch: float  # of which moving state, KV and fixed switch costs
    rollout: float  # pool seconds with a sequence decoding and no training
    busy: float  # rollout + train
    together: float  # of `rollout`, seconds with two or more jobs' rollouts in flight
    tokens: int


def _measure(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _sweep(rollouts: list[tuple[float, float, int]], trains: list[tuple[float, float]]) -> tuple[float, float]:
    """(seconds some rollout is on and no training, seconds two or more rollouts are on and no training)."""
    ev = [(a, 1, 0) for a, _, _ in rollouts] + [(b, -1, 0) for _, b, _ in rollouts]
    ev += [(a, 0, 1) for a, _ in trains] + [(b, 0, -1) for _, b in trains]
    ev.sort()
    on = tr = 0
    prev = 0.0
    one = two = 0.0
    for t, dr, dt in ev:
        if tr == 0:
            one += (t - prev) if on >= 1 else 0.0
            two += (t - prev) if on >= 2 else 0.0
        on, tr, prev = on + dr, tr + dt, t
    return one, two


def simulate_pool(sc: Scenario, dep: Deployment, acc: Accelerator, k: int) -> EngineRun:
    """`k` jobs sharing one pool's engine for `sc.workload.steps` steps each (see the module docstring)."""
    model, eff, work, lora = sc.model, sc.efficiency, sc.workload, sc.lora
    layout = pool_layout(sc, dep)
    tp = dep.rollout_tp or sc.rollout_tp
    size = layout.accelerators
    if size < tp:
        raise DoesNotFit(f"a pool of {size} accelerators cannot hold one rollout replica of TP{tp}")
    weights = model.params_b * 1e9 * 2 / tp
    copies = 1 if lora is not None else k
    resident = float(train_state_bytes(model, layout, lora) + (k - 1) * adapter_bytes(layout, lora)) if lora else 0.0
    room = acc.hbm_gb * GB * eff.memory_utilization
    if copies * weights + resident >= room:
        base = " plus the resident training base and adapters" if lora is not None else ""
        raise DoesNotFit(
            f"{dep.name}: {k} jobs' rollouts in one engine need {copies} {'copies' if copies > 1 else 'copy'} of "
            f"{model.name}'s weights ({weights / GB:.0f} GB per accelerator at TP{tp}){base}, more than "
            f"{eff.memory_utilization:.0%} of {acc.name}'s {acc.hbm_gb:g} GB: raise rollout_tp or lower jobs_per_pool"
        )
    # the same draws as `rollout_samples` and `step_table` on this pool (one job here is the colocated run)
    rng = random.Random(f"rollout/{sc.seed}/{model.name}/{size}/{tp}")
    dec = Decoder(acc, model, eff, tp, mean_context(work, rng), reserved=(copies - 1) * weights + resident)
    state = adapter_bytes(layout, lora) if lora is not None else train_state_bytes(model, layout)
    # host DRAM: the swapped-out states (and offloaded optimizers), slept weights, and the in-flight KV cache
    need_host = host_bytes(model, layout, tp, k, True, False, lora, shared_base=lora is not None)
    check_host(acc, need_host + dec.kv_room / tp, dep.name)
    fits_training = copies * weights + train_state_bytes(model, layout, lora) + eff.train_reserve_gb * GB
    weights_move = 0.0 if fits_training <= acc.hbm_gb * GB * eff.memory_utilization else copies * weights
    replicas = size // tp
    overhead = lora.decode_overhead if lora is not None else 0.0
    slots = {j: (dec.slots if lora is not None else max(1, dec.slots // k)) for j in range(k)}
    reps = [_Replica(dec, slots, lora is not None, overhead) for _ in range(replicas)]
    n = work.prompts * work.samples
    batches = []
    for _ in range(sc.rollout_samples):
        lengths = draw_lengths(work.response, n, rng)
        rng.shuffle(lengths)
        batches.append(lengths)
    verify = lognormal_draws(
        work.verify.median, work.verify.sigma, len(batches), random.Random(f"step/{sc.seed}/{model.name}")
    )
    prefill_rate = acc.peak_tflops * 1e12 * eff.prefill_mfu / (2 * model.active_b * 1e9 * work.prompt_tokens / tp)
    kv_token = model.kv_bytes_per_token() * dec.context / tp  # bytes per accelerator of one running sequence

    events: list[tuple[float, int, str, int, int]] = []
    seq = 0

    def push(t: float, kind: str, a: int, b: int = 0) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, a, b))

    def schedule(r: int) -> None:
        rep = reps[r]
        rep.version += 1
        t = rep.next_end()
        if t < math.inf:
            push(t, "end", r, rep.version)

    step = [0] * k
    left = [0] * k
    started = [0.0] * k
    done = [0.0] * k
    tokens = 0
    spans_roll: list[tuple[float, float, int]] = []
    spans_train: list[tuple[float, float]] = []
    waiting: deque[int] = deque()
    training = False
    switch_total = 0.0

    def arrive(j: int, now: float) -> None:
        nonlocal tokens
        lengths = batches[(j * 7919 + step[j] * 104729) % len(batches)]
        tokens += sum(lengths)
        left[j] = len(lengths)
        started[j] = now
        for r, rep in enumerate(reps):
            mine = lengths[r::replicas]
            if not mine:
                continue
            rep.advance(now)
            rep.t += len(mine) / prefill_rate
            rep.enqueue(j, mine)
            rep.admit()
            schedule(r)

    def try_train(now: float) -> None:
        nonlocal training, switch_total
        if training or not waiting:
            return
        j = waiting.popleft()
        lengths = batches[(j * 7919 + step[j] * 104729) % len(batches)]
        train = train_seconds(acc, model, eff, work, layout, sum(lengths) + work.prompt_tokens * n, lora)
        kv = max((len(rep.running) for rep in reps), default=0) * kv_token
        switch = 2 * ((kv + state + weights_move) / (acc.host_gbps * GB) + eff.switch_fixed_s) + eff.sync_fixed_s
        d = train + switch
        switch_total += switch
        for r, rep in enumerate(reps):
            rep.advance(now)
            rep.t += d
            schedule(r)
        training = True
        spans_train.append((now, now + d))
        push(now + d, "trained", j)

    for j in range(k):
        arrive(j, 0.0)
    while events:
        now, _, kind, a, b = heapq.heappop(events)
        if kind == "end":
            rep = reps[a]
            if b != rep.version:
                continue
            while True:  # this replica's ends, until another event comes first
                rep.advance(now)
                rep.s = max(rep.s, rep.running[0][0])  # the event is this sequence's end (float-exact)
                while rep.running and rep.running[0][0] <= rep.s + EPS:
                    _, j = heapq.heappop(rep.running)
                    rep.count[j] -= 1
                    left[j] -= 1
                    if left[j] == 0:
                        spans_roll.append((started[j], now, j))
                        push(now + verify[(j + step[j]) % len(verify)], "verified", j)
                rep.admit()
                te = rep.next_end()
                if te == math.inf or (events and events[0][0] <= te):
                    break
                now = te
            schedule(a)
        elif kind == "verified":
            waiting.append(a)
            try_train(now)
        else:  # trained
            training = False
            step[a] += 1
            if step[a] < work.steps:
                arrive(a, now)
            else:
                done[a] = now
            try_train(now)
    makespan = max(done)
    rolling, together = _sweep(spans_roll, spans_train)
    train_total = _measure(spans_train)
    return EngineRun(makespan, done, train_total, switch_total, rolling, rolling + train_total, together, tokens)


def run_engine_deployment(sc: Scenario, dep: Deployment, acc: Accelerator | None = None) -> DeploymentResult:
    """A `plexrl-engine` deployment's row: one pool simulated, its accounting counted for every pool."""
    acc = acc or sc.accelerator
    k = dep.jobs_per_pool
    n = scenario_jobs(sc)
    run = simulate_pool(sc, dep, acc, k)
    services = math.ceil(n / k)
    size = pool_layout(sc, dep).accelerators
    ref = reference_rate(acc, sc.model, sc.efficiency, sc.workload)
    steps = n * sc.workload.steps
    jct = {f"job{i:03d}": run.jct[i % k] for i in range(n)}
    tp = dep.rollout_tp or sc.rollout_tp
    return DeploymentResult(
        dep.name, dep.kind, services, size, 0, n, steps, run.makespan, services * size * run.makespan,
        services * size * run.busy, services * run.switch, run.tokens / (size * run.rollout * ref),
        rollout=services * size * run.rollout, jct=jct, step_seconds=sum(jct.values()) / steps,
        layout=f"TP{tp} one engine x{k}" + (" (LoRA)" if sc.lora else ""), off_policy=False,
        tail_overlap=run.together / run.rollout if run.rollout else 0.0,
    )  # fmt: skip
