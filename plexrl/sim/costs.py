"""Cost models of one RLVR step on given accelerators: rollout (continuous-batching decode with long-tailed
response lengths), training at a stated MFU, weight sync, engine switches and state moves. Pure functions of
the configs in `plexrl.sim.config` and a seeded RNG; no torch, no I/O. Every constant comes from the YAML.

Rollout, per replica of `tp` accelerators (`docs/simulator.md` derives it):
- the batch's responses are shuffled and dealt round-robin to the replicas; a replica runs up to `slots`
  sequences at once (vLLM `max_num_seqs`, or fewer if the KV cache cannot hold them at the running context:
  prompt + E[L^2] / 2E[L], since under continuous batching a sequence runs for a time proportional to its
  length, so the running set is biased toward long sequences; colocated with a resident training state,
  that state's bytes are taken from the KV room),
  admitting the next queued sequence the moment one ends (continuous batching);
- one decode step with `n` running sequences reads the weights it touches (MoE: the experts the `n` tokens
  route to) plus the KV cache of the `n` sequences, at `decode_bw` of HBM bandwidth, or is compute bound at
  `decode_mfu` of peak, whichever is slower, plus a fixed `decode_step_ms`;
- as sequences finish and the queue is empty, the batch shrinks and each step makes fewer tokens: the long
  tail. The step's rollout ends with its slowest replica.
Decoding efficiency = tokens made / (rollout accelerators * rollout time * one reference rate per
accelerator): the best full-batch rate per accelerator any rollout TP reaches on this model (one scale for
every layout of a scenario, so a layout whose replicas are small or KV-starved shows as less efficient).

Training: (6 + 2 * forward_passes) * active parameters * tokens FLOPs (forward + backward, plus the extra
forward passes for old-policy and reference log-probs) at `train_mfu` of the pool's peak, stretched by the
pipeline bubble (pp - 1) / microbatches; with optimizer offload, 4 bytes per parameter of the rank's shard
cross the host link each step (gradients down, weights up) and each node's CPUs run Adam over its
accelerators' shards (`cpu_adam_gparams_s`). Attention FLOPs are not counted (they add a few
percent at these lengths; `train_mfu` absorbs them).
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plexrl.runtime.sim import SimJob
from plexrl.sim.config import GB, Accelerator, Efficiency, LengthDist, LoRA, Model, TrainLayout, Workload


class DoesNotFit(ValueError):
    """A model does not fit the accelerators it was given."""


@dataclass(frozen=True, slots=True)
class RolloutSample:
    """One simulated rollout of a step's batch: wall seconds, generated and prompt tokens, decoding efficiency."""

    seconds: float
    tokens: int
    prompt_tokens: int
    efficiency: float


def draw_lengths(dist: LengthDist, n: int, rng: random.Random) -> list[int]:
    """`n` response lengths (tokens, >= 1, <= max_tokens)."""
    if dist.empirical:
        return [min(max(int(x), 1), dist.max_tokens) for x in rng.choices(dist.empirical, k=n)]
    mu = math.log(dist.median)
    return [min(max(int(rng.lognormvariate(mu, dist.sigma)), 1), dist.max_tokens) for _ in range(n)]


class Decoder:
    """One rollout replica of `tp` accelerators: its concurrency and its decode step time."""

    def __init__(
        self, acc: Accelerator, model: Model, eff: Efficiency, tp: int, context: float, reserved: float = 0.0
    ) -> None:
        self.acc, self.model, self.eff, self.tp = acc, model, eff, tp
        weights = model.params_b * 1e9 * 2 / tp  # bf16 weights on each accelerator
        kv_room = tp * (acc.hbm_gb * GB * eff.memory_utilization - weights - reserved)
        if kv_room <= 0:
            held = f" plus {reserved / GB:.0f} GB of resident training state" if reserved else ""
            raise DoesNotFit(
                f"{model.name} needs {weights / GB:.0f} GB of weights per accelerator at rollout TP{tp}{held}, more "
                f"than {eff.memory_utilization:.0%} of {acc.name}'s {acc.hbm_gb:g} GB: raise rollout_tp"
                + (" or offload the training state (resident: false)" if reserved else "")
            )
        self.kv_room = kv_room
        self.slots = max(1, min(eff.max_num_seqs, int(kv_room / (model.kv_bytes_per_token() * context))))
        self.context = context
        expert = model.expert_params_b() * 1e9
        self._shared = model.active_b * 1e9 - (expert * model.experts_per_token / model.experts if expert else 0.0)
        self._expert = expert
        self._bw = acc.hbm_tbps * 1e12 * eff.decode_bw
        self._flops = acc.peak_tflops * 1e12 * eff.decode_mfu
        self._cache: dict[int, float] = {}

    def step_seconds(self, n: int) -> float:
        """One decode step with `n` running sequences at the mean context."""
        t = self._cache.get(n)
        if t is None:
            m = self.model
            touched = 1 - (1 - m.experts_per_token / m.experts) ** n if self._expert else 0.0
            read = (self._shared + self._expert * touched) * 2 / self.tp
            read += n * self.context * m.kv_bytes_per_token() / self.tp
            compute = 2 * m.active_b * 1e9 * n / self.tp / self._flops
            fixed = self.eff.decode_step_ms + (self.eff.internode_step_ms if self.tp > self.acc.per_node else 0.0)
            t = self._cache[n] = max(read / self._bw, compute) + fixed / 1000
        return t

    def full_rate(self) -> float:
        """Tokens per second with every slot busy."""
        return self.slots / self.step_seconds(self.slots)

    def run(self, lengths: list[int], prompt_tokens: int) -> float:
        """Seconds to prefill and decode these sequences (continuous batching, all queued at the start)."""
        slots = min(self.slots, len(lengths))
        if slots == 0:
            return 0.0
        if len(lengths) <= slots:
            ends = sorted(lengths)
        else:  # each sequence goes to the slot that frees first (in token steps)
            heap = [0] * slots
            for n in lengths:
                heapq.heapreplace(heap, heap[0] + n)
            ends = sorted(heap)
        t, prev = 0.0, 0
        for k, end in enumerate(ends):  # between two slot ends, slots - k sequences run
            if end > prev:
                t += (end - prev) * self.step_seconds(slots - k)
                prev = end
        prefill = 2 * self.model.active_b * 1e9 * prompt_tokens * len(lengths) / self.tp
        return t + prefill / (self.acc.peak_tflops * 1e12 * self.eff.prefill_mfu)


def mean_context(work: Workload, rng: random.Random) -> float:
    """Mean tokens in a running sequence's KV cache under continuous batching: the prompt plus
    E[L^2] / (2 E[L]). A sequence of length L is in the running set for a time proportional to L and holds
    L/2 tokens of response on average meanwhile, so the set is length-biased (the inspection paradox)."""
    sample = draw_lengths(work.response, 4096, rng)
    return work.prompt_tokens + sum(x * x for x in sample) / (2 * sum(sample))


def reference_rate(acc: Accelerator, model: Model, eff: Efficiency, work: Workload) -> float:
    """Tokens per second per accelerator at full batch, the best over rollout TP 1, 2, 4, 8 that fit: the one
    scale decoding efficiency is measured on for every layout of a scenario."""
    context = mean_context(work, random.Random(f"context/{model.name}"))
    best = 0.0
    for tp in (1, 2, 4, 8):
        try:
            best = max(best, Decoder(acc, model, eff, tp, context).full_rate() / tp)
        except DoesNotFit:
            continue
    if not best:
        raise DoesNotFit(f"{model.name} fits no rollout TP up to 8 on {acc.name}")
    return best


def rollout_samples(
    acc: Accelerator, model: Model, eff: Efficiency, work: Workload, accelerators: int, tp: int, k: int, seed: int,
    reserved: float = 0.0,
) -> tuple[list[RolloutSample], Decoder]:  # fmt: skip
    """`k` seeded rollouts of one step's batch on `accelerators` accelerators in replicas of `tp` (`reserved`:
    device bytes per accelerator a resident training state holds)."""
    if accelerators < tp:
        raise DoesNotFit(f"{accelerators} rollout accelerators cannot hold one replica of TP{tp}")
    rng = random.Random(f"rollout/{seed}/{model.name}/{accelerators}/{tp}")
    dec = Decoder(acc, model, eff, tp, mean_context(work, rng), reserved)
    ref = reference_rate(acc, model, eff, work)
    replicas = accelerators // tp
    n = work.prompts * work.samples
    out = []
    for _ in range(k):
        lengths = draw_lengths(work.response, n, rng)
        rng.shuffle(lengths)
        seconds = max(dec.run(lengths[r::replicas], work.prompt_tokens) for r in range(min(replicas, n)))
        tokens = sum(lengths)
        out.append(RolloutSample(seconds, tokens, work.prompt_tokens * n, tokens / (replicas * tp * seconds * ref)))
    return out, dec


# -- training, state, moves ---------------------------------------------------------------------------------
def rank_params(model: Model, layout: TrainLayout) -> float:
    """Parameters held by one training rank (dense: P / (tp * pp); MoE: shared / tp + experts / ep, over pp)."""
    expert = model.expert_params_b() * 1e9
    shared = model.params_b * 1e9 - expert
    return (shared / layout.tp + expert / layout.ep) / layout.pp


def adapter_bytes(layout: TrainLayout, lora: LoRA) -> int:
    """Per-accelerator bytes of one LoRA job's own state: the adapter in fp32 with its gradients and two Adam
    moments (16 bytes per parameter), spread over the pool's tp * pp ranks like the base it adapts."""
    return int(lora.params_b * 1e9 * 16 / (layout.tp * layout.pp))


def train_state_bytes(model: Model, layout: TrainLayout, lora: LoRA | None = None) -> int:
    """Device bytes of one rank's training state: bf16 weights, bf16 gradients (sharded over dp with ZeRO-2),
    fp32 master weights and Adam moments (12 bytes, sharded with ZeRO >= 1; on the host with offload). A LoRA
    job: the frozen bf16 base shard plus its adapter state (`adapter_bytes`)."""
    p = rank_params(model, layout)
    if lora is not None:
        return int(2 * p) + adapter_bytes(layout, lora)
    grads = 2 / layout.dp if layout.zero >= 2 else 2.0
    optim = 0.0 if layout.offload else (12 / layout.dp if layout.zero >= 1 else 12.0)
    return int(p * (2 + grads + optim))


def train_seconds(
    acc: Accelerator, model: Model, eff: Efficiency, work: Workload, layout: TrainLayout, tokens: int,
    lora: LoRA | None = None,
) -> float:  # fmt: skip
    """One training step over `tokens` (prompts + responses) on the layout's accelerators. LoRA: the backward
    pass computes no gradients of the frozen base weights, so forward + backward is 4 instead of 6 x active
    params FLOPs per token (LoRA Without Regret, Schulman et al. 2025: ~2/3 of full fine-tuning's compute;
    the adapter's own FLOPs are under 1% at these ranks), and its small optimizer stays on device (no
    offload, no CPU-Adam)."""
    flops = ((4 if lora is not None else 6) + 2 * work.forward_passes) * model.active_b * 1e9 * tokens
    t = flops / (layout.accelerators * acc.peak_tflops * 1e12 * eff.train_mfu)
    t *= 1 + (layout.pp - 1) / layout.microbatches
    if layout.offload and lora is None:
        p = rank_params(model, layout)
        t += 4 * p / (acc.host_gbps * GB)  # bf16 gradients down, bf16 weights up
        shard = p / (layout.dp if layout.zero >= 1 else 1)  # the optimizer shard this rank updates
        t += shard * acc.per_node / (eff.cpu_adam_gparams_s * 1e9)  # one node's CPUs, all its ranks
    return t


def sync_seconds(
    acc: Accelerator, model: Model, eff: Efficiency, senders: int, replicas: int = 1, tp: int = 1,
    lora: LoRA | None = None,
) -> float:  # fmt: skip
    """Push new bf16 weights (LoRA: the adapter only) from the training pool to `replicas` rollout engines of
    `tp` accelerators over the network: every replica receives the whole model (its accelerators in
    parallel), and the senders' links carry one copy per replica."""
    size = (lora.params_b if lora is not None else model.params_b) * 1e9 * 2
    wire = max(size * replicas / (acc.net_gbps * GB * senders), size / tp / (acc.net_gbps * GB))
    return wire + eff.sync_fixed_s


def switch_seconds(
    acc: Accelerator, model: Model, eff: Efficiency, layout: TrainLayout, rollout_tp: int, resident: bool = False,
    lora: LoRA | None = None,
) -> float:  # fmt: skip
    """Colocated: one step's two switches (vLLM sleep level 1 style: the KV cache is dropped, not moved). The
    rollout weights go to host and back; offloaded (`resident=False`), so does the training state."""
    state = 0 if resident else train_state_bytes(model, layout, lora)
    moved = model.params_b * 1e9 * 2 / rollout_tp + state
    return 2 * (moved / (acc.host_gbps * GB) + eff.switch_fixed_s)


def host_bytes(
    model: Model, layout: TrainLayout, rollout_tp: int, jobs: int, on_pool: bool, resident: bool,
    lora: LoRA | None = None, shared_base: bool = False,
) -> float:  # fmt: skip
    """Host DRAM per accelerator a pool of `jobs` jobs needs: each job's offloaded optimizer shard, the training
    states swapped out (all but one job's; with the rollout on the pool and offloaded, every job's), and
    where the rollout is on the pool each job's slept rollout weights (pinned buffers stay allocated). LoRA
    jobs on one base (`shared_base`): only adapters are swapped, and the base's slept weights are held once."""
    p = rank_params(model, layout)
    optim = 12 * p / (layout.dp if layout.zero >= 1 else 1) if layout.offload and lora is None else 0.0
    state = adapter_bytes(layout, lora) if lora is not None and shared_base else train_state_bytes(model, layout, lora)
    swapped = jobs if on_pool and not resident else jobs - 1
    copies = 1 if shared_base else jobs
    weights = copies * model.params_b * 1e9 * 2 / rollout_tp if on_pool else 0.0
    return jobs * optim + swapped * state + weights


def check_host(acc: Accelerator, need: float, what: str) -> None:
    if need > acc.host_gb * GB:
        raise DoesNotFit(
            f"{what} needs {need / GB:.0f} GB of host DRAM per accelerator, more than {acc.name}'s {acc.host_gb:g} "
            "GB (host_gb): fewer jobs per pool, more rollout TP, or a resident state"
        )


def lognormal_draws(median: float, sigma: float, k: int, rng: random.Random) -> tuple[float, ...]:
    if median <= 0:
        return (0.0,) * k
    return tuple(rng.lognormvariate(math.log(median), sigma) for _ in range(k))


# -- the simulator's cost source ----------------------------------------------------------------------------
def _mix(x: int) -> int:
    """splitmix64: a fast, well-spread integer hash (deterministic across processes, unlike `hash`)."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


@dataclass(slots=True)
class SwapFit:
    """The swap model's constants fitted from recorded moves (`fit_swap`): seconds of a move of `n` bytes =
    `n / bandwidth + fixed_s`, over `moves` moves of `nbytes` bytes in all."""

    bandwidth: float  # bytes / s (inf when nothing moved)
    fixed_s: float
    moves: int
    nbytes: int


def fit_swap(records: Iterable[Mapping[str, Any]], *, background: bool | None = None) -> SwapFit:
    """Fit `SwapFit` to move records as a timeline keeps them (`moves.json`: `plexrl.reports.MoveRecord` as
    dicts): each move's seconds are its copy plus its wait (its queueing is another move's time), fitted by
    least squares on its bytes; one size only (or a negative intercept): a line through the origin.
    `background`: only background moves (True), only blocking ones (False), or all (None). Feeds
    `SampledCosts.swap_bandwidth` / `move_fixed_s` (docs/simulator.md)."""
    pts = [(float(r["nbytes"]), float(r["copy"]) + float(r["wait"])) for r in records
           if r["nbytes"] > 0 and (background is None or bool(r["background"]) == background)]  # fmt: skip
    total = int(sum(b for b, _ in pts))
    seconds = sum(t for _, t in pts)
    if not pts or seconds <= 0:
        return SwapFit(math.inf, 0.0, len(pts), total)
    n = len(pts)
    mb, mt = total / n, seconds / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    if var > 0:
        slope = sum((b - mb) * (t - mt) for b, t in pts) / var
        fixed = mt - slope * mb
        if slope > 0 and fixed >= 0:
            return SwapFit(1 / slope, fixed, n, total)
    return SwapFit(total / seconds, 0.0, n, total)


@dataclass(slots=True)
class SampledCosts:
    """`SimCosts` that draw each node's duration from the job's `samples` table (constant `means` where a
    node has none). One draw index per (seed, job, iteration), shared by all nodes of the iteration, so a
    long rollout and its long training step come together. Moves at `swap_bandwidth` bytes/s (per
    accelerator; a service's accelerators move their shards in parallel), loads at `load_bandwidth`."""

    seed: int
    swap_bandwidth: float
    load_bandwidth: float
    move_fixed_s: float = 0.0  # seconds every move pays besides its bytes (time-slicing's switch cost each way)
    _keys: dict[str, int] = field(default_factory=dict)

    def index(self, job_id: str, iteration: int) -> int:
        key = self._keys.get(job_id)
        if key is None:
            key = self._keys[job_id] = _mix(zlib.crc32(job_id.encode()) ^ (self.seed << 32))
        return _mix(key ^ (iteration & 0xFFFFFFFF))

    def duration(self, job: SimJob, iteration: int, node: str) -> float:
        samples = job.samples.get(node)
        if not samples:
            return job.means[node]
        return samples[self.index(job.job_id, iteration) % len(samples)]

    def swap_seconds(self, nbytes: int) -> float:
        return nbytes / self.swap_bandwidth + (self.move_fixed_s if nbytes else 0.0)

    def load_seconds(self, job: SimJob, nbytes: int) -> float:
        return nbytes / self.load_bandwidth
