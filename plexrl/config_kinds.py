"""Which kind of config a YAML is, and its check with the model of that kind (`plexrl validate`).

Kinds: `job` (`plexrl run`), `cluster` (`plexrl run`, a top-level `jobs:` list), `server` (`plexrl serve
--config`), `scenario` and `trace` (`plexrl simulate`) and `profiles` (configs/sim/profiles.yaml, read by
the simulator configs). A simulator config says its kind (`kind: scenario` / `kind: trace`); the others are
recognised by their keys: a `jobs` list is a cluster; otherwise the kind whose model knows the most of the
file's top-level keys (ties: job, server, scenario, trace). `read_config` parses a file ONCE and detects its
kind; `plexrl run` and `check_config` (`plexrl validate`) both start from it, so they agree on the kind of
every file, and each kind's loader gets the parsed YAML. `check_config` validates with that kind's own loader,
so a check passes exactly when the command that runs the file would accept it. A job is also held to the size
limits a server applies at submission (`plexrl.server.limits.job_problems` on the job's footprint: the limits of
a given server config, else `plexrl serve`'s defaults), so that a job `plexrl serve` would refuse for its size
(a 1 TiB KV cache) does not pass.

Nothing here runs a job or imports torch: the loaders only parse, validate and build graphs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from plexrl.errors import ConfigError, Problem

Kind = Literal["job", "cluster", "server", "scenario", "trace", "profiles"]
KINDS: tuple[Kind, ...] = ("job", "cluster", "server", "scenario", "trace", "profiles")
EXPLICIT: tuple[Kind, ...] = ("scenario", "trace")  # the kinds that carry a `kind:` field
_BY_SHAPE: tuple[Kind, ...] = ("job", "server", "scenario", "trace")  # tie order


RUNS: dict[Kind, str] = {  # the command that runs each kind
    "job": "plexrl run",
    "cluster": "plexrl run",
    "server": "plexrl serve --config",
    "scenario": "plexrl simulate",
    "trace": "plexrl simulate",
    "profiles": "plexrl simulate (through a scenario that names it)",
}


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """A config file parsed once: its YAML (`raw`; None for no file: the job defaults), its kind and why."""

    path: Path | None
    raw: Any
    kind: Kind
    why: str


@dataclass(frozen=True, slots=True)
class Checked:
    """A config that passed: its kind, why it was read as that kind, and the lines that summarise it."""

    kind: Kind
    why: str
    lines: tuple[str, ...]


def _keys(model: type[BaseModel]) -> set[str]:
    names = set(model.model_fields)
    names |= {f.alias for f in model.model_fields.values() if f.alias}
    return names


def _models() -> dict[Kind, type[BaseModel]]:
    from plexrl.cluster import ClusterConfig
    from plexrl.job.config import JobConfig
    from plexrl.server.config import ServerConfig
    from plexrl.sim.config import Scenario, Trace

    return {"job": JobConfig, "cluster": ClusterConfig, "server": ServerConfig, "scenario": Scenario, "trace": Trace}


def detect_kind(raw: Any, source: str = "config") -> tuple[Kind, str]:
    """The kind of a parsed YAML and the reason it was chosen; a `kind:` that names no kind is a ConfigError."""
    if not isinstance(raw, dict):
        return "job", "not a mapping"  # the job loader says what a config must be
    kind = raw.get("kind")
    if kind is not None:
        if kind in EXPLICIT:
            return kind, f"kind: {kind}"
        hint = (
            f"kind: {kind!r} is not a config kind that a file declares; `kind:` is one of "
            f"{', '.join(EXPLICIT)} (plexrl simulate). Job, cluster and server configs are recognised by their keys: "
            "remove the `kind:` line"
        )
        raise ConfigError([Problem("kind", hint)], source)
    if isinstance(raw.get("jobs"), list):
        return "cluster", "a top-level `jobs:` list"
    if raw and set(raw) <= {"accelerators", "models"}:
        return "profiles", "only `accelerators:` and `models:` tables"
    keys = set(raw)
    models = _models()
    known = {k: len(keys & _keys(models[k])) for k in _BY_SHAPE}
    best = max(_BY_SHAPE, key=lambda k: known[k])  # max keeps the first of equals: the tie order
    if not keys or known[best] == 0:
        return "job", "no keys of any kind: read as a job (the defaults fill in the rest)"
    return best, f"by its keys: {known[best]} of {len(keys)} are {best} fields"


def read_config(path: Path | None) -> ConfigFile:
    """Parse `path` (bounded: `plexrl.yamlio`) and detect its kind; None: the job defaults. A missing file or
    a `kind:` that names no kind is a ConfigError."""
    if path is None:
        return ConfigFile(None, None, "job", "no file: the embedded defaults")
    from plexrl.yamlio import load_yaml_file

    if not path.is_file():
        raise ConfigError([Problem("path", f"{path}: file not found; give a YAML under configs/")], str(path))
    raw = load_yaml_file(path)
    kind, why = detect_kind(raw, str(path))
    return ConfigFile(path, raw, kind, why)


def runnable(file: ConfigFile) -> None:
    """Raise a ConfigError unless `plexrl run` runs this kind (a job or a cluster), naming the command that does."""
    if file.kind not in ("job", "cluster"):
        where = str(file.path)
        message = f"a {file.kind} config ({file.why}) is not run by `plexrl run`: use `{RUNS[file.kind]}`"
        raise ConfigError([Problem("kind", message)], where)


def _overrides_dict(overrides: Iterable[str]) -> dict[str, Any]:
    """`FIELD=VALUE` strings as `plexrl simulate --set` reads them (top-level fields, YAML values)."""
    from plexrl.yamlio import load_yaml_text

    out: dict[str, Any] = {}
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError([Problem("--set", f"{item!r}: expected key=value, e.g. --set jobs=100")], "--set")
        out[key] = load_yaml_text(value, f"--set {item}")
    return out


def _check_profiles(raw: dict[str, Any], source: str) -> tuple[str, ...]:
    from pydantic import ValidationError

    from plexrl.sim.config import Accelerator, Model

    problems: list[Problem] = []
    tables: dict[str, type[BaseModel]] = {"accelerators": Accelerator, "models": Model}
    for table, model in tables.items():
        entries = raw.get(table) or {}
        if not isinstance(entries, dict):
            problems.append(Problem(table, "expected a mapping of profile name -> fields"))
            continue
        for name, fields in entries.items():
            try:
                model.model_validate(fields)
            except ValidationError as exc:
                for e in exc.errors():
                    where = ".".join([table, str(name), *map(str, e["loc"])])
                    problems.append(Problem(where, f"{e['msg']} (see docs/simulator.md)"))
    if problems:
        raise ConfigError(problems, source)
    counts = {t: len(raw.get(t) or {}) for t in tables}
    return (f"{counts['accelerators']} accelerator and {counts['models']} model profile(s)",)


def check_config(path: Path | None, overrides: list[str] | None = None, server: Path | None = None) -> Checked:
    """Detect the kind of `path` (None: the default job) and validate it with that kind's loader; a
    ConfigError lists every problem. A job is also checked against the size limits of the server config
    `server` (None: `plexrl serve`'s defaults). The summary lines name what the file describes."""
    overrides = overrides or []
    file = read_config(path)
    raw, kind, why, source = file.raw, file.kind, file.why, str(path)
    if kind == "job":
        return Checked(kind, why, _job_lines(path, overrides, raw, server))
    assert path is not None
    if kind == "cluster":
        from plexrl.cluster import load_cluster

        cluster = load_cluster(path, overrides, raw=raw)
        lines = [f"{len(cluster.jobs)} jobs on {_runtime_line(cluster.config)}"]
        lines += [f"  {j.config.name:<24} pipeline {j.graph.name!r} ({len(j.graph.order)} nodes)" for j in cluster.jobs]
        return Checked(kind, why, tuple(lines))
    if kind == "server":
        from plexrl.server.config import load_server_config

        s = load_server_config(path, overrides, parsed=raw)
        line = f"serves on {s.host}:{s.port}, journal {s.journal}, {_runtime_line(s.cluster)}"
        return Checked(kind, why, (line,))
    if kind == "profiles":
        assert isinstance(raw, dict)
        return Checked(kind, why, _check_profiles(raw, source))
    from plexrl.sim.config import Scenario, load_sim

    cfg = load_sim(path, _overrides_dict(overrides))
    if isinstance(cfg, Scenario):
        names = ", ".join(d.name for d in cfg.deployments)
        line = f"scenario {cfg.name!r}: {cfg.model.name} on {cfg.accelerator.name}, deployments {names}"
    else:
        line = (
            f"trace {cfg.name!r}: {cfg.jobs} jobs over {cfg.days:g} days on {cfg.services} service(s), "
            f"placements {', '.join(cfg.placements)}"
        )
    return Checked(kind, why, (line,))


def _runtime_line(c: Any) -> str:
    """A runtime section in words: services, policies, driver."""
    return f"{c.services.count} service(s), placement {c.placement}, ordering {c.ordering}, driver {c.driver}"


def _server_limits(path: Path | None) -> tuple[Any, str]:
    """The job limits of the server config at `path` (None: the defaults) and where they come from."""
    from plexrl.server.limits import JobLimits

    if path is None:
        return JobLimits.model_validate({}), "the default limits of `plexrl serve` (--server SERVER.yaml: another's)"
    from plexrl.server.config import load_server_config

    return load_server_config(path, []).limits, f"the limits of the server config {path}"


def _job_lines(path: Path | None, overrides: list[str], raw: Any, server: Path | None = None) -> tuple[str, ...]:
    import json

    from plexrl.job.footprint import footprint
    from plexrl.job.load import load_job
    from plexrl.server.limits import job_problems, reward_timeouts

    loaded = load_job(path, overrides, parsed=raw)
    limits, whose = _server_limits(server)
    over = job_problems(footprint(loaded), limits, reward_timeouts(loaded.config.model_dump()))
    if over:  # the server's own check at submission, on the same footprint
        raise ConfigError(over, f"{path or 'the default job'}, against {whose}")
    lines = [f"pipeline {loaded.graph.name!r} with {len(loaded.graph.order)} nodes"]
    for node in loaded.graph.describe():
        lines.append(f"  {node['name']:<12} {node['runs_on']:<8} {node['op']}  inputs={json.dumps(node['inputs'])}")
    cfg = loaded.config
    if cfg.data is not None:  # open the files as run would (same errors), resolve the rewards
        from plexrl.job.data_check import check_data, data_cache_dir

        tokenizer_dir = Path(cfg.model.path) if cfg.model.path is not None else None
        if cfg.model.pretrained is not None:
            from plexrl.job.pretrained import pretrained_path

            try:
                tokenizer_dir = pretrained_path(cfg.model.pretrained, convert=False)
            except LookupError:
                tokenizer_dir = None
        lines += check_data(cfg.data, data_cache_dir(cfg.data, cfg.run_dir), tokenizer_dir)
    return tuple(lines)


__all__ = ["KINDS", "RUNS", "Checked", "ConfigFile", "Kind", "check_config", "detect_kind", "read_config", "runnable"]
