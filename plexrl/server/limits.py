"""What one job, and all open jobs together, may cost on this server: `JobLimits` (the server config's `limits:`
section), checked on a submission's `Footprint` (`plexrl.job.footprint`) BEFORE the job is journalled, so that
no accepted job can exhaust the server. A job over a limit is refused with 400, naming the job's
field, its value, the limit and the setting that holds it.

Checked at submission (`job_problems`): iterations, the model's parameters, the estimated memory (state, vLLM
engine, one rollout batch), the KV cache, a rollout batch's tokens, the task's train and evaluation sizes, the
LoRA rank, warm-start steps, and every reward term's `timeout_s` (`max_reward_timeout_s`). Checked against the
jobs already open (queued or running: `OpenJobs`): their count and the sum of their memory. Tinker sessions are
open jobs too: counted in the same count and in the same sum of memory (`session_bytes`: a session's state,
counted as a job's), and a new one goes through the same check (`admit`, with the base model's parameters
against `max_parameters`). With two users or more, each keyed user's share of `max_open_jobs` (the count over
the users, the one submitting included) is kept free for them while they use less of it: another user may fill
the rest, never their share, so no user's jobs or sessions lock another user out.

Enforced while the job runs, elsewhere: `max_run_s` and `max_iterations` (`plexrl.server.housekeeping`: a job
running longer fails with the reason), `max_cpu_node_s` (a CPU node that passes it fails its job:
`plexrl.runtime.cpu_nodes`), `max_data_bytes` and `max_line_bytes` (where data files are read:
`plexrl.paths`), `prepare_memory` and `prepare_timeout_s` (the preparation's own process:
`plexrl.server.preparation`).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ByteSize, Field

from plexrl.errors import ConfigError, Problem
from plexrl.job.footprint import Footprint
from plexrl.job.model_config import StrictModel

GiB = 1 << 30


class JobLimits(StrictModel):
    """Per-job and per-server limits on what jobs may cost (see plexrl/server/limits.py and docs/operations.md)."""

    max_iterations: int = Field(100_000, ge=1, description="Largest `iterations` a job may ask for.")
    max_run_s: float | None = Field(
        7 * 86400.0,
        gt=0,
        description="Wall-clock seconds a job may run per placement (from the moment it is placed); past it the "
        "job fails with the reason. None: no limit.",
    )
    max_parameters: int = Field(
        8_000_000_000, ge=1, description="Largest model (parameters; a built model's counted from its sizes)."
    )
    max_job_bytes: ByteSize = Field(
        ByteSize(64 * GiB),
        description="Largest estimated memory of one job: its state (weights, optimizer, reference, critic), its "
        "vLLM engine (weights + KV cache) and one rollout batch.",
    )
    max_kv_cache_bytes: ByteSize = Field(ByteSize(32 * GiB), description="Largest vLLM KV cache of one job.")
    max_rollout_tokens: int = Field(
        16 << 20, ge=1, description="Largest rollout batch: n x batch_size sequences x (prompt + response tokens)."
    )
    max_train_size: int = Field(2_000_000, ge=16, description="Largest generated train split (`task.train_size`).")
    max_eval_size: int = Field(
        100_000, ge=8, description="Largest evaluation (task, warm start or pipeline `eval_size`)."
    )
    max_lora_r: int = Field(256, ge=1, description="Largest LoRA rank (`model.lora.r`).")
    max_reward_timeout_s: float = Field(
        60.0, gt=0, le=600, description="Largest `timeout_s` of a reward term (each call's time limit)."
    )
    max_cpu_node_s: float | None = Field(
        1800.0,
        gt=0,
        description="Wall-clock seconds one CPU node may run; past it the node's process is killed and its job "
        "fails (the server and other jobs go on). None: no limit (the node runs in the worker itself).",
    )
    max_data_bytes: ByteSize = Field(ByteSize(16 * GiB), description="Largest data file a job may name.")
    max_line_bytes: ByteSize = Field(ByteSize(64 << 20), description="Longest line of a jsonl or csv data file.")
    max_open_jobs: int = Field(1000, ge=1, description="Jobs queued or running at once, all users together.")
    max_open_bytes: ByteSize = Field(
        ByteSize(1024 * GiB), description="Sum of the estimated memory of the jobs queued or running at once."
    )
    prepare_memory: ByteSize | None = Field(
        ByteSize(16 * GiB),
        description="Address space of a job's preparation process (task build, model build, warm start: run "
        "outside the server process); past it the preparation fails with the reason. None: prepare in the "
        "server process (tests, trusted setups).",
    )
    prepare_timeout_s: float = Field(
        4 * 3600.0, gt=0, description="Wall-clock seconds a job's preparation may take before it is killed."
    )


def job_problems(fp: Footprint, limits: JobLimits, timeouts: dict[str, float]) -> list[Problem]:
    """Why a job with this footprint exceeds `limits` (empty: it fits). `timeouts`: each reward term's config
    field (`data.rewards[i].timeout_s`) -> its value."""
    checks: list[tuple[str, int | float, int | float, str, Callable[[float], str]]] = [
        ("iterations", fp.iterations, limits.max_iterations, "max_iterations", _count),
        ("parameters", fp.parameters, limits.max_parameters, "max_parameters", _count),
        ("kv_cache_bytes", fp.kv_cache_bytes, limits.max_kv_cache_bytes, "max_kv_cache_bytes", _bytes),
        ("rollout_tokens", fp.rollout_tokens, limits.max_rollout_tokens, "max_rollout_tokens", _count),
        ("train_size", fp.train_size, limits.max_train_size, "max_train_size", _count),
        ("eval_size", fp.eval_size, limits.max_eval_size, "max_eval_size", _count),
        ("lora_r", fp.lora_r, limits.max_lora_r, "max_lora_r", _count),
    ]
    problems = []
    for key, value, limit, setting, show in checks:
        if value > limit:
            problems.append(
                Problem(
                    fp.fields[key],
                    f"{show(value)} ({key.replace('_', ' ')}); this server takes at most {show(limit)} "
                    f"(limits.{setting}): lower it",
                )
            )
    if fp.memory_bytes > limits.max_job_bytes and not problems:
        parts = f"state {_bytes(fp.state_bytes)}, engine {_bytes(fp.engine_bytes)}, rollouts {_bytes(fp.rollout_bytes)}"
        biggest = max(("state_bytes", "engine_bytes", "rollout_bytes"), key=lambda k: getattr(fp, k))
        problems.append(
            Problem(
                fp.fields[biggest],
                f"the job needs about {_bytes(fp.memory_bytes)} ({parts}); this server takes at most "
                f"{_bytes(limits.max_job_bytes)} per job (limits.max_job_bytes): make it smaller",
            )
        )
    for where, seconds in timeouts.items():
        if seconds > limits.max_reward_timeout_s:
            problems.append(
                Problem(
                    where,
                    f"{seconds:g} s per call; this server allows at most {limits.max_reward_timeout_s:g} s "
                    "(limits.max_reward_timeout_s): lower it",
                )
            )
    return problems


def _count(x: float) -> str:
    return f"{int(x):,}"


def _bytes(x: float) -> str:
    return f"{x / GiB:.3g} GiB" if x >= GiB else f"{x / (1 << 20):.3g} MiB"


class OpenJobs:
    """The jobs open on this server (queued or running) and their memory, for the per-server limits. Thread-safe.
    `open_ids()` maps the open jobs (the journal's) to their users; `weigh(job_id)` estimates one not seen at
    submission (a job recovered from the journal), 0 when it cannot; `users`: the server's keyed users, whose
    shares of `max_open_jobs` are kept for them (see the module docstring)."""

    def __init__(
        self, open_ids: Callable[[], dict[str, str]], weigh: Callable[[str], int], users: Sequence[str] = ()
    ) -> None:
        self.open_ids, self.weigh, self.users = open_ids, weigh, sorted(set(users))
        self.lock = threading.Lock()  # held across `check` and the journalling of the job (`admit`)
        self._bytes: dict[str, int] = {}

    def check(self, memory: int, limits: JobLimits, user: str | None = None) -> list[Problem]:
        """Why one more job of `memory` bytes, of `user` (None: the administrator), does not fit now (call with
        `lock` held)."""
        open_now = self.open_ids()
        for gone in set(self._bytes) - set(open_now):
            del self._bytes[gone]
        for job_id in set(open_now) - set(self._bytes):
            self._bytes[job_id] = self.weigh(job_id)
        problems = []
        cap = limits.max_open_jobs
        if len(open_now) >= cap:
            problems.append(
                Problem(
                    "server",
                    f"{len(open_now)} jobs are queued or running, this server's limit (limits.max_open_jobs); "
                    "submit again when some have ended",
                )
            )
        elif len(self.users) >= 2:
            # (a user the administrator submits for, outside the keyed ones, counts as one more user)
            members = set(self.users) | ({user} if user else set())
            share, held = max(1, cap // len(members)), Counter(open_now.values())
            kept = sum(max(0, share - held[u]) for u in members if u != user)
            if len(open_now) + 1 + kept > cap:
                problems.append(
                    Problem(
                        "server",
                        f"{held[user or '']} of the {len(open_now)} open jobs (sessions included) are user "
                        f"{user!r}'s; the {cap - len(open_now)} places left of limits.max_open_jobs ({cap}) are "
                        f"kept for the other users' shares ({share} each); submit again when some of yours have "
                        "ended (or ask the server's owner to raise limits.max_open_jobs)",
                    )
                )
        total = sum(self._bytes.values())
        if total + memory > limits.max_open_bytes:
            problems.append(
                Problem(
                    "server",
                    f"the open jobs need about {_bytes(total)} and this one {_bytes(memory)}: more than this "
                    f"server's {_bytes(limits.max_open_bytes)} (limits.max_open_bytes); submit again when some "
                    "have ended (sessions included: close a ServiceClient), or ask the server's owner to raise it",
                )
            )
        return problems

    def add(self, job_id: str, memory: int) -> None:
        """A job was journalled (call with `lock` held)."""
        self._bytes[job_id] = memory


def admit(
    open_jobs: OpenJobs, limits: JobLimits, user: str, parameters: int, memory: int, submit: Callable[[], str]
) -> str:
    """A Tinker session's job, through the job API's limits: its base model's `parameters` against
    `max_parameters`, then `open_jobs.check` of its `memory` (`session_bytes`) and `submit()` (which journals
    it) as one step; its job id. ConfigError (naming each limit) when it does not fit."""
    problems = []
    if parameters > limits.max_parameters:
        problems.append(
            Problem(
                "base_model",
                f"{_count(parameters)} parameters; this server takes at most {_count(limits.max_parameters)} "
                "(limits.max_parameters): use a smaller model",
            )
        )
    with open_jobs.lock:
        problems += open_jobs.check(memory, limits, user)
        if problems:
            raise ConfigError(problems, "session")
        job_id = submit()
        open_jobs.add(job_id, memory)
    return job_id


def session_bytes(config: dict[str, Any]) -> int:
    """A Tinker session's memory (its journalled `SessionConfig`), counted as a job's is
    (`plexrl.job.budget.device_need`): a training session's state (its weights and 2 AdamW moments, or a LoRA
    adapter and its moments) and the base a LoRA session shares; a sampling-only session's weights. 0 when its
    model cannot be read (its opening says why)."""
    from plexrl.job.budget import device_need
    from plexrl.job.load import LoadedJob
    from plexrl.sessions.operators import session_graph
    from plexrl.sessions.spec import SessionConfig
    from plexrl.sizes import model_bytes

    try:
        cfg = SessionConfig.model_validate(config)
        job = cfg.job_config()
        if cfg.client.get("sampler_only"):
            return model_bytes(Path(str(job.model.path)), job.model.dtype)
        need = device_need(LoadedJob(job, session_graph(), config, "session"))
        return need.state + need.engine
    except Exception:
        return 0


def open_jobs_of(journal: Any, modules: list[str], users: Sequence[str] = ()) -> OpenJobs:
    """The `OpenJobs` of a server's journal: its queued and running jobs; one recovered from the journal weighed
    from its journalled config (compiled under the allow-list `modules`; 0 if it no longer compiles); `users`:
    the server's keyed users."""

    def open_ids() -> dict[str, str]:
        return {e.job_id: e.user for status in ("queued", "running") for e in journal.jobs(status, 1_000_000)}

    def weigh(job_id: str) -> int:
        from plexrl.job.footprint import footprint
        from plexrl.job.load import load_job
        from plexrl.roles import allowed_modules

        entry = journal.get(job_id)
        if entry is not None and entry.config.get("kind") == "session":
            return session_bytes(entry.config)
        if entry is None or entry.config.get("kind", "job") != "job":
            return 0
        try:
            with allowed_modules(modules):
                return footprint(load_job(entry.config)).memory_bytes
        except Exception:
            return 0

    return OpenJobs(open_ids, weigh, users)


def reward_timeouts(config: dict[str, Any]) -> dict[str, float]:
    """Each reward term's `timeout_s` by its field, from a validated config dumped as a dict."""
    terms = (config.get("data") or {}).get("rewards") or []
    return {f"data.rewards[{i}].timeout_s": float(t.get("timeout_s", 0)) for i, t in enumerate(terms)}


__all__ = ["JobLimits", "OpenJobs", "admit", "job_problems", "open_jobs_of", "reward_timeouts", "session_bytes"]
