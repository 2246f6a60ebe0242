"""Cost models of one RLVR step on given accelerators: rollout (continuous-batching decode with long-tailed
response lengths), training at a stated MFU, weight sync, engine switches and state moves. Pure functions of
the configs in `plexrl.sim.config` and a seeded RNG; no torch, no I/O. Every constant comes from the YAML.

Rollout, per replica of `tp` accelerators (`docs/simulator.md` derives it):
- the batch's responses are shuffled and dealt round-robin to the replicas; a replica runs up to `slots`
  sequences at once (vLLM `max_num_seqs`, or fewer if the KV cache cannot hold them at the mean context),
  admitting the next queued sequence the moment one ends (continuous batching);
- one decode step with `n` running sequences reads the weights it touches (MoE: the experts the `n` tokens
  route to) plus the KV cache of the `n` sequences, at `decode_bw` of HBM bandwidth, or is compute bound at
  `decode_mfu` of peak, whichever is slower, plus a fixed `decode_step_ms`;
- as sequences finish and the queue is empty, the batch shrinks and each step makes fewer tokens: the long
  tail. The step's rollout ends with its slowest replica.
Decoding efficiency = tokens made / (replicas * rollout time * the replica's full-batch token rate): the
share of the rollout accelerators' decode capacity the step used (the paper's "decoding efficiency").

Training: (6 + 2 * forward_passes) * active parameters * tokens FLOPs (forward + backward, plus the extra
forward passes for old-policy and reference log-probs) at `train_mfu` of the pool's peak, stretched by the
pipeline bubble (pp - 1) / microbatches; with optimizer offload, 4 bytes per parameter of the rank's shard
cross the host link each step (gradients down, weights up). Attention FLOPs are not counted (they add a few
percent at these lengths; `train_mfu` absorbs them).
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from dataclasses import dataclass, field

from plexrl.runtime.sim import SimJob
from plexrl.sim.config import GB, Accelerator, Efficiency, LengthDist, Model, TrainLayout, Workload


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

    def __init__(self, acc: Accelerator, model: Model, eff: Efficiency, tp: int, context: float) -> None:
        self.acc, self.model, self.eff, self.tp = acc, model, eff, tp
        weights = model.params_b * 1e9 * 2 / tp  # bf16 weights on each accelerator
        kv_room = tp * (acc.hbm_gb * GB * eff.memory_utilization - weights)
        if kv_room <= 0:
            raise DoesNotFit(
                f"{model.name} needs {weights / GB:.0f} GB of weights per accelerator at rollout TP{tp}, more than "
                f"{eff.memory_utilization:.0%} of {acc.name}'s {acc.hbm_gb:g} GB: raise rollout_tp"
            )
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
            t = self._cache[n] = max(read / self._bw, compute) + self.eff.decode_step_ms / 1000
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
    """Mean tokens in a running sequence's KV cache: the prompt plus half a mean response."""
    sample = draw_lengths(work.response, 4096, rng)
    return work.prompt_tokens + sum(sample) / len(sample) / 2


def rollout_samples(
    acc: Accelerator, model: Model, eff: Efficiency, work: Workload, accelerators: int, tp: int, k: int, seed: int
) -> tuple[list[RolloutSample], Decoder]:
    """`k` seeded rollouts of one step's batch on `accelerators` accelerators in replicas of `tp`."""
    if accelerators < tp:
        raise DoesNotFit(f"{accelerators} rollout accelerators cannot hold one replica of TP{tp}")
    rng = random.Random(f"rollout/{seed}/{model.name}/{accelerators}/{tp}")
    dec = Decoder(acc, model, eff, tp, mean_context(work, rng))
    replicas = accelerators // tp
    n = work.prompts * work.samples
    out = []
    for _ in range(k):
        lengths = draw_lengths(work.response, n, rng)
        rng.shuffle(lengths)
        seconds = max(dec.run(lengths[r::replicas], work.prompt_tokens) for r in range(min(replicas, n)))
        tokens = sum(lengths)
        out.append(
            RolloutSample(seconds, tokens, work.prompt_tokens * n, tokens / (replicas * seconds * dec.full_rate()))
        )
    return out, dec


# -- training, state, moves ---------------------------------------------------------------------------------
def rank_params(model: Model, layout: TrainLayout) -> float:
    """Parameters held by one training rank (dense: P / (tp * pp); MoE: shared / tp + experts / ep, over pp)."""
    expert = model.expert_params_b() * 1e9
    shared = model.params_b * 1e9 - expert
    return (shared / layout.tp + expert / layout.ep) / layout.pp


def train_state_bytes(model: Model, layout: TrainLayout) -> int:
    """Device bytes of one rank's training state: bf16 weights, bf16 gradients (sharded over dp with ZeRO-2),
    fp32 master weights and Adam moments (12 bytes, sharded with ZeRO >= 1; on the host with offload)."""
    p = rank_params(model, layout)
    grads = 2 / layout.dp if layout.zero >= 2 else 2.0
    optim = 0.0 if layout.offload else (12 / layout.dp if layout.zero >= 1 else 12.0)
    return int(p * (2 + grads + optim))


def train_seconds(
    acc: Accelerator, model: Model, eff: Efficiency, work: Workload, layout: TrainLayout, tokens: int
) -> float:
    """One training step over `tokens` (prompts + responses) on the layout's accelerators."""
    flops = (6 + 2 * work.forward_passes) * model.active_b * 1e9 * tokens
    t = flops / (layout.accelerators * acc.peak_tflops * 1e12 * eff.train_mfu)
    t *= 1 + (layout.pp - 1) / layout.microbatches
    if layout.offload:
        t += 4 * rank_params(model, layout) / (acc.host_gbps * GB)
    return t


def sync_seconds(acc: Accelerator, model: Model, eff: Efficiency, senders: int) -> float:
    """Push new bf16 weights from the training pool to the rollout engines over the network."""
    return model.params_b * 1e9 * 2 / (acc.net_gbps * GB * senders) + eff.sync_fixed_s


def switch_seconds(acc: Accelerator, model: Model, eff: Efficiency, layout: TrainLayout, rollout_tp: int) -> float:
    """Colocated: one step's two switches: the training state out to host and the rollout weights in, then
    back (vLLM sleep level 1 style: the KV cache is dropped, not moved)."""
    moved = train_state_bytes(model, layout) + model.params_b * 1e9 * 2 / rollout_tp
    return 2 * (moved / (acc.host_gbps * GB) + eff.switch_fixed_s)


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
class SampledCosts:
    """`SimCosts` that draw each node's duration from the job's `samples` table (constant `means` where a
    node has none). One draw index per (seed, job, iteration), shared by all nodes of the iteration, so a
    long rollout and its long training step come together. Moves at `swap_bandwidth` bytes/s (per
    accelerator; a service's accelerators move their shards in parallel), loads at `load_bandwidth`."""

    seed: int
    swap_bandwidth: float
    load_bandwidth: float
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
        return nbytes / self.swap_bandwidth

    def load_seconds(self, job: SimJob, nbytes: int) -> float:
        return nbytes / self.load_bandwidth
