"""The server's YAML (`plexrl serve --config server.yaml`): where it listens, its journal, what submissions may
name, and under `cluster:` the runtime section its one runner is built from (`RuntimeConfig`, embedded whole:
every setting of a cluster config's services, driver and policies, and nothing copied)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ByteSize, Field, ValidationError, model_validator

from plexrl.errors import ConfigError, Problem, pydantic_problem
from plexrl.job.load import apply_overrides
from plexrl.job.model_config import StrictModel
from plexrl.runtime.config import RuntimeConfig
from plexrl.runtime.tls import is_loopback
from plexrl.server.http import HttpConfig
from plexrl.server.limits import JobLimits
from plexrl.server.tinker.config import TinkerConfig


class ServerConfig(StrictModel):
    """`plexrl serve`: listening address, journal, submission policy, and the cluster it runs (`cluster:`)."""

    cluster: RuntimeConfig = Field(
        default_factory=RuntimeConfig,  # type: ignore[arg-type]
        description="The services, driver and policies of the server's one runner: the runtime section of a "
        "cluster config (every field a cluster config takes but its jobs and its run's name and outputs).",
    )

    host: str = Field("127.0.0.1", description="Address to bind. Anything but loopback requires `token`.")
    port: int = Field(8765, ge=0, le=65535, description="TCP port (0: any free port, printed at start).")
    token: str | None = Field(
        None,
        min_length=16,
        description="Bearer token every request must carry (compared in constant time); or env PLEXRL_TOKEN.",
    )
    users: dict[str, str] | None = Field(
        None,
        description="User name -> that user's bearer token (16+ characters each). A request carrying one acts as "
        "that user: its jobs are recorded as theirs (quotas, fair share) and it may cancel only those. `token` "
        "stays the administrator's (any user's jobs).",
    )
    private_jobs: bool | None = Field(
        None,
        description="With `users`: a user reads only their own jobs' configs and events (another user's answer 404, "
        "as a job that does not exist); other users' jobs still appear in lists and on the cluster page, without "
        "their reason, MLflow run, checkpoint, node names or metrics. The administrator (`token`) reads everything. "
        "None (default): on when `users` is set.",
    )
    journal: str = Field("runs/server/journal.db", description="The sqlite journal (WAL); reuse it to recover.")
    run_dir: str = Field("runs", description="Default run_dir of submitted jobs; the server's timelines go here.")
    allowed_roots: list[str] | None = Field(
        None,
        description="Every path a job names (run_dir, model.path, data files and cache) must lie under one of "
        "these (default: [run_dir]); checked at submission and again where each file is opened. With private "
        "jobs a job writes only in its user's directory, <run_dir>/users/<user> (plexrl/server/files.py).",
    )
    allowed_modules: list[str] = Field(
        ["plexrl"],
        description="Dotted paths in a job (pipeline builders, operators, any 'pkg.module:name' value) must be "
        "in one of these packages; checked before anything is imported.",
    )
    max_body_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description="Largest request body accepted.")
    mlflow: bool = Field(True, description="Track every job in MLflow (a run per job, per attempt).")
    checkpoint_every: int | None = Field(
        None,
        ge=1,
        description="Save each job's state every k iterations; a restart, or the loss of the job's service, "
        "resumes it from the latest one, exactly. Must be a multiple of every periodic node's `every`. "
        "None: jobs restart from scratch.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="Placements of one job in all (every job's plan carries it): the planner places a job whose "
        "service is lost again (from its latest checkpoint) until it has had this many.",
    )
    checkpoint_dir: str | None = Field(
        None, description="Where checkpoints go (default: a `checkpoints` folder next to the journal)."
    )
    prepare_workers: int = Field(
        2,
        ge=1,
        le=32,
        description="Threads that prepare submitted jobs (task data, model build, warm start) at once; one user "
        "holds at most prepare_workers - 1 of them (at least 1), so one user's long warm starts do not hold up "
        "another's job. Each warm start trains on this machine's CPU (or its first GPU): keep it small.",
    )
    tinker: TinkerConfig = Field(
        default_factory=TinkerConfig,  # type: ignore[arg-type]
        description="The Tinker-compatible API under /api/v1: sessions driven by the `tinker` SDK, as jobs.",
    )
    max_warm_start_steps: int = Field(
        5000,
        ge=0,
        description="Largest `warm_start.max_steps` a submitted job may ask for (a warm start runs in the job's "
        "preparation); a job above it is refused, or fails its preparation with the reason.",
    )
    limits: JobLimits = Field(
        default_factory=JobLimits,  # type: ignore[arg-type]
        description="What one job, and all open jobs together, may cost: sizes checked before a job is accepted, "
        "times and memory enforced while it is prepared and runs (plexrl/server/limits.py).",
    )
    http: HttpConfig = Field(
        default_factory=HttpConfig,  # type: ignore[arg-type]
        description="The names the server answers to and its connections' limits (plexrl/server/http.py).",
    )
    checkpoint_retention_s: float = Field(
        86400.0,
        ge=0,
        description="Seconds the checkpoints of a cancelled or failed job are kept (for a look, or a resubmission) "
        "before they are removed; a done job's go at once. 0: removed when the job ends.",
    )
    min_free_disk: ByteSize = Field(
        ByteSize(1 << 30),
        description="Free bytes the disk of the journal and checkpoints must keep: below it /health answers 503 "
        "and submissions are refused (the server stays up; running jobs go on, their checkpoints may fail).",
    )

    @model_validator(mode="before")
    @classmethod
    def _cluster_fields_under_cluster(cls, data: Any) -> Any:
        if isinstance(data, dict):
            flat = sorted(k for k in data if k in RuntimeConfig.model_fields)
            if flat:
                moved = ", ".join(f"cluster.{k}" for k in flat)
                raise ValueError(
                    f"{', '.join(flat)}: a setting of the cluster the server runs goes under `cluster:` ({moved}); "
                    "move it there (the section takes every field of a cluster config but its jobs)"
                )
        return data

    @model_validator(mode="after")
    def _token_off_loopback(self) -> ServerConfig:
        if not is_loopback(self.host) and self.token is None and not self.users:
            raise ValueError(
                f"binding {self.host!r} exposes the server beyond this machine: set `token` (16+ characters), "
                "`users`, or the environment variable PLEXRL_TOKEN, or bind 127.0.0.1"
            )
        for user, secret in (self.users or {}).items():
            if not user or len(user) > 64 or len(secret) < 16:
                raise ValueError(f"users: {user!r} needs a name of 1-64 characters and a token of 16+ characters")
        if self.private_jobs and not self.users:
            raise ValueError(
                "private_jobs: true needs per-user tokens (`users`): without them every request is the "
                "administrator's and sees every job; add `users`, or drop `private_jobs`"
            )
        secrets = list((self.users or {}).values()) + ([self.token] if self.token else [])
        if len(set(secrets)) != len(secrets):
            raise ValueError("users: two identities share a token; give each user (and the administrator) its own")
        return self

    def jobs_private(self) -> bool:
        """Whether a user's token reads only that user's jobs' details (`private_jobs`, resolved)."""
        return bool(self.users) if self.private_jobs is None else self.private_jobs

    def checkpoints(self) -> Path:
        """The checkpoint directory, resolved."""
        return Path(self.checkpoint_dir or Path(self.journal).parent / "checkpoints").resolve()

    def roots(self) -> list[Path]:
        """The allowed roots, resolved."""
        return [Path(r).resolve() for r in (self.allowed_roots or [self.run_dir])]


def load_server_config(
    path: Path | None, overrides: list[str] | None = None, token: str | None = None, *, parsed: Any = None
) -> ServerConfig:
    """Read and validate a server YAML (None: defaults) with `key=value` overrides; one ConfigError lists every
    problem. `token` (from PLEXRL_TOKEN) is used when the file sets none. `parsed`: the file already parsed
    (`config_kinds.read_config`)."""
    import copy

    from plexrl.yamlio import load_yaml_file

    raw: Any = {}
    source = "server defaults"
    if path is not None:
        source = str(path)
        raw = (copy.deepcopy(parsed) if parsed is not None else load_yaml_file(path)) or {}
        if not isinstance(raw, dict):
            raise ConfigError([Problem(source, "a server config must be a YAML mapping")], source)
    problems = apply_overrides(raw, overrides or [])
    if token and raw.get("token") is None:
        raw["token"] = token
    try:
        cfg = ServerConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(problems + [pydantic_problem(e, "", ServerConfig) for e in exc.errors()], source) from None
    if problems:
        raise ConfigError(problems, source)
    return cfg


__all__ = ["ServerConfig", "is_loopback", "load_server_config"]
