"""What the server accepts as a job: `check_submission` reads a submitted job YAML within `plexrl.yamlio`'s
limits, applies `--set` overrides, checks the server owner's policy, validates the job like `plexrl validate`,
and returns the config to journal, or raises ONE `ConfigError` naming every problem.

Policy, checked on the parsed, TYPED config (after every coercion the schema makes) and on the raw values,
BEFORE anything is compiled (compiling imports the modules that dotted paths name):
- every string of the form `pkg.module:name` (`plexrl.roles.parse_ref`), anywhere in the config, names a
  module inside `allowed_modules`; compiling then runs under `plexrl.roles.allowed_modules`, so an import that
  a builder or operator attempts from a string the scan did not see is refused at the import itself, and a
  dotted path names only code declared for its role (no project helper can be called as a "builder");
- `name` is a plain identifier, matched whole (it becomes part of the job id, of MLflow run names and of file
  paths);
- `run_dir`, `model.path` and the data paths (`data.train`, `data.held_out`, `data.cache_dir`) are allowed by the
  user's `FilePolicy` (`plexrl.paths`, from `server/files.py`: under the allowed roots, never the server's own
  files, with private jobs written only in the user's own directory); `~` is refused (the server's home is not
  the user's); a path outside gets the same answer whether or not it exists (nothing about it is looked up);
  the accepted config holds every path resolved, and the same policy is checked again where each file is opened;
- `tracking.uri` is the server owner's, not the job's: a job may not set it;
- with `max_warm_start_steps`, an enabled warm start runs at most that many steps.
After compiling (allowed modules only):
- every reward `ref` resolves to a function declared as a reward (`@declare("reward")`), importable now: an
  undeclared or missing one is refused here, not at preparation;
- with `limits`, the job's `Footprint` (`plexrl.job.footprint`: model, memory, rollout batch, KV cache, task and
  evaluation sizes, LoRA rank, iterations, reward time limits) is within the server's `JobLimits`.
A submission refused by the policy is never compiled: no module it names is imported, no path it names is
opened. An exception raised by an allowed user module while the job compiles is a problem of the
submission (a 400 naming it), not a server error.

What it does NOT check: what the allowed modules do when imported or run (the allow-list is the trust
boundary), quotas, and the limits on all open jobs together (`limits.OpenJobs`, in the API).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexrl.errors import ConfigError, Problem
from plexrl.job.footprint import footprint
from plexrl.paths import FilePolicy, resolve
from plexrl.roles import module_allowed, parse_ref
from plexrl.server.limits import JobLimits, job_problems, reward_timeouts

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", re.ASCII)  # used with fullmatch: no trailing newline
MAX_SETS = 100


@dataclass(frozen=True, slots=True)
class Accepted:
    """A submission that passed: the job's name, its validated config (JSON-able, overrides and defaults
    applied, run_dir absolute) and its iteration count."""

    name: str
    config: dict[str, Any]
    iterations: int
    memory: int = 0  # the job's estimated memory (`Footprint.memory_bytes`), for the per-server limit


def check_submission(
    text: str,
    overrides: list[str],
    *,
    run_dir: Path,
    roots: list[Path],
    modules: list[str],
    checkpoint_every: int | None = None,
    max_warm_start_steps: int | None = None,
    policy: FilePolicy | None = None,
    limits: JobLimits | None = None,
) -> Accepted:
    """See the module docstring. `run_dir`: the user's default run_dir; `roots`: resolved allowed roots (the
    policy, when `policy` is None: read and write under them); `policy`: the user's (`ServerFiles.policy`);
    `limits`: the server's per-job limits (None: none);
    `modules`: allowed top-level packages or modules (a module matches itself and its submodules);
    `checkpoint_every`: the server's, which every periodic node's `every` must divide (a job resumed after
    iteration k*j - 1 must keep its evaluations in phase); `max_warm_start_steps`: the server's cap on a
    job's supervised warm start (None: no cap)."""
    from pydantic import ValidationError

    from plexrl.errors import pydantic_problem
    from plexrl.job.config import JobConfig
    from plexrl.job.load import apply_overrides, load_job
    from plexrl.roles import allowed_modules
    from plexrl.yamlio import load_yaml_text

    if len(overrides) > MAX_SETS:
        raise ConfigError([Problem("set", f"{len(overrides)} overrides; at most {MAX_SETS}")], "submission")
    raw = load_yaml_text(text, "job") or {}  # plain values only: any YAML tag is refused there
    if not isinstance(raw, dict):
        raise ConfigError([Problem("job", "a job config must be a YAML mapping of keys to values")], "job")
    problems = apply_overrides(raw, overrides)
    raw.setdefault("run_dir", str(run_dir))
    policy = policy if policy is not None else FilePolicy(tuple(roots))
    typed: JobConfig | None = None
    try:  # the schema alone: pydantic, no import, no file opened
        typed = JobConfig.model_validate(raw)
    except ValidationError as exc:
        problems += [pydantic_problem(e, "", JobConfig) for e in exc.errors()]
    # the policy on the raw values and on the typed config: a coercion cannot hide a value from it
    refused = _policy_problems(raw, modules, policy, max_warm_start_steps)
    if typed is not None:
        refused += _policy_problems(typed.model_dump(), modules, policy, max_warm_start_steps)
    problems += _unique(refused)
    if problems:  # never compile what the policy or the schema refuses
        raise ConfigError(_unique(problems), "job")
    try:
        with allowed_modules(modules):
            loaded = load_job(raw)
    except ConfigError as exc:
        raise ConfigError(exc.problems, "job") from None
    except Exception as exc:  # an allowed module's code failed while the job compiled: the submission's problem
        log.warning("a submission failed to compile", exc_info=True)
        raise ConfigError([Problem("job", f"compiling the job raised {type(exc).__name__}: {exc}")], "job") from None
    for node in loaded.graph.nodes:
        if checkpoint_every is not None and node.every is not None and checkpoint_every % node.every:
            problems.append(
                Problem(
                    f"pipeline node {node.name!r}",
                    f"runs every {node.every} iterations, which does not divide the server's checkpoint_every "
                    f"({checkpoint_every}); a resumed job would evaluate out of phase: make it divide it",
                )
            )
    with allowed_modules(modules):
        problems += reward_problems(loaded.config.model_dump())
    memory = 0
    if limits is not None and not problems:
        fp = footprint(loaded)
        problems += job_problems(fp, limits, reward_timeouts(loaded.config.model_dump()))
        memory = fp.memory_bytes
    if problems:
        raise ConfigError(problems, "job")
    config = loaded.config.model_dump(mode="json")
    for keys in PATHS:  # resolved once, here: what is opened later is what was checked (and checked again)
        section = config.get(keys[0]) if len(keys) == 2 else config
        if isinstance(section, dict) and isinstance(section.get(keys[-1]), str):
            section[keys[-1]] = str(resolve(section[keys[-1]]))
    return Accepted(loaded.config.name, config, loaded.config.iterations, memory)


PATHS = (("run_dir",), ("model", "path"), ("data", "train"), ("data", "held_out"), ("data", "cache_dir"))
WRITTEN = frozenset({"run_dir", "data.cache_dir"})  # the job writes there: the policy's write rule applies


def reward_problems(config: dict[str, Any]) -> list[Problem]:
    """Each reward `ref` of a validated config (dumped) that does not resolve to a declared reward, under the
    allow-list in force (`roles.resolve`: the module is imported; it is inside the allow-list)."""
    from plexrl.roles import resolve as resolve_ref

    out = []
    for i, term in enumerate((config.get("data") or {}).get("rewards") or []):
        ref = term.get("ref")
        if ref is None:
            continue
        try:
            resolve_ref(ref, "reward")
        except LookupError as exc:
            out.append(Problem(f"data.rewards[{i}].ref", str(exc)))
    return out


def path_problems(config: dict[str, Any], policy: FilePolicy) -> list[Problem]:
    """The paths of a config (raw or validated) that `policy` refuses; see the module docstring."""
    problems = _path_problem(config.get("run_dir"), "run_dir", policy)
    model = config.get("model")
    if isinstance(model, dict) and model.get("path") is not None:
        problems += _path_problem(model["path"], "model.path", policy)
    data = config.get("data")
    if isinstance(data, dict):  # the job's data files and their cache are read (and written) by the server
        for key in ("train", "held_out", "cache_dir"):
            if data.get(key) is not None:
                problems += _path_problem(data[key], f"data.{key}", policy)
    return problems


def _policy_problems(
    cfg: dict[str, Any], modules: list[str], policy: FilePolicy, max_warm_start_steps: int | None
) -> list[Problem]:
    """The owner's policy on one view of the config (raw or typed-and-dumped); see the module docstring."""
    problems = _dotted_problems(cfg, modules, "")
    name = cfg.get("name", "grpo-arithmetic")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        problems.append(
            Problem("name", f"{name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
        )
    problems += path_problems(cfg, policy)
    tracking = cfg.get("tracking")
    if isinstance(tracking, dict) and tracking.get("uri") is not None:
        problems.append(Problem("tracking.uri", "set by the server's owner; remove it from the job"))
    warm = cfg.get("warm_start")
    if max_warm_start_steps is not None and isinstance(warm, dict) and warm.get("enabled", True) is not False:
        steps = warm.get("max_steps", 3000)  # the schema's default (WarmStartConfig.max_steps)
        if not isinstance(steps, int) or steps > max_warm_start_steps:
            problems.append(
                Problem(
                    "warm_start.max_steps",
                    f"{steps!r} (or the default 3000) exceeds this server's max_warm_start_steps "
                    f"({max_warm_start_steps}); lower it, or disable the warm start",
                )
            )
    return problems


def _unique(problems: list[Problem]) -> list[Problem]:
    seen: set[tuple[str, str]] = set()
    out = []
    for p in problems:
        if (p.where, p.message) not in seen:
            seen.add((p.where, p.message))
            out.append(p)
    return out


def _dotted_problems(value: Any, modules: list[str], where: str) -> list[Problem]:
    out: list[Problem] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _dotted_problems(v, modules, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            out += _dotted_problems(v, modules, f"{where}[{i}]")
    elif isinstance(value, str | bytes):
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        ref = parse_ref(text.strip())
        if ref is not None and not module_allowed(ref[0], modules):
            out.append(
                Problem(
                    where,
                    f"{text.strip()!r} names module {ref[0]!r}, outside this server's allowed modules "
                    f"{modules}; ask the server's owner to add it to `allowed_modules`",
                )
            )
    return out


def _path_problem(value: Any, where: str, policy: FilePolicy) -> list[Problem]:
    if not isinstance(value, str):
        return []  # the schema reports the type
    if "\0" in value:
        return [Problem(where, "contains a NUL character; give a plain path")]
    if value.startswith("~"):
        return [Problem(where, f"{value[:200]!r}: `~` would be this server's home, not yours; give the full path")]
    path = resolve(value)  # symlinks followed; nothing is created or read
    why = policy.problem(path, where in WRITTEN)
    return [] if why is None else [Problem(where, f"{value[:200]!r} resolves to {path}: {why}")]


__all__ = ["PATHS", "Accepted", "check_submission", "path_problems", "reward_problems"]
