"""What the server accepts as a job: `check_submission` reads a submitted job YAML within `plexrl.yamlio`'s
limits, applies `--set` overrides, checks the server owner's policy, validates the job like `plexrl validate`,
and returns the config to journal, or raises ONE `ConfigError` naming every problem.

Policy (checked BEFORE the job is compiled, because compiling imports the modules that dotted paths name):
- every string of the form `pkg.module:name`, anywhere in the config, names a module inside `allowed_modules`;
- `name` is a plain identifier (it becomes part of the job id, of MLflow run names and of file paths);
- `run_dir` and `model.path` resolve under one of the allowed roots (a missing `run_dir` becomes the server's);
- `tracking.uri` is the server owner's, not the job's: a job may not set it.

What it does NOT check: what the allowed modules do when imported or run (the allow-list is the trust
boundary), quotas, and whether the cluster can hold the job (the planner fails a job no service fits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plexrl.errors import ConfigError, Problem

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DOTTED = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*:\s*[A-Za-z_]\w*\s*$")
MAX_SETS = 100


@dataclass(frozen=True, slots=True)
class Accepted:
    """A submission that passed: the job's name, its validated config (JSON-able, overrides and defaults
    applied, run_dir absolute) and its iteration count."""

    name: str
    config: dict[str, Any]
    iterations: int


def check_submission(
    text: str,
    overrides: list[str],
    *,
    run_dir: Path,
    roots: list[Path],
    modules: list[str],
    checkpoint_every: int | None = None,
) -> Accepted:
    """See the module docstring. `run_dir`: the server's default run_dir; `roots`: resolved allowed roots;
    `modules`: allowed top-level packages or modules (a module matches itself and its submodules);
    `checkpoint_every`: the server's, which every periodic node's `every` must divide (a job resumed after
    iteration k*j - 1 must keep its evaluations in phase)."""
    from pydantic import ValidationError

    from plexrl.config import JobConfig, _problem, apply_overrides, load_job
    from plexrl.yamlio import load_yaml_text

    if len(overrides) > MAX_SETS:
        raise ConfigError([Problem("set", f"{len(overrides)} overrides; at most {MAX_SETS}")], "submission")
    raw = load_yaml_text(text, "job") or {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem("job", "a job config must be a YAML mapping of keys to values")], "job")
    problems = apply_overrides(raw, overrides)
    imports = _dotted_problems(raw, modules, "")
    problems += imports
    name = raw.get("name", "grpo-arithmetic")
    if not isinstance(name, str) or not NAME.match(name):
        problems.append(
            Problem("name", f"{name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
        )
    raw.setdefault("run_dir", str(run_dir))
    problems += _path_problem(raw.get("run_dir"), "run_dir", roots)
    model = raw.get("model")
    if isinstance(model, dict) and model.get("path") is not None:
        problems += _path_problem(model["path"], "model.path", roots)
    tracking = raw.get("tracking")
    if isinstance(tracking, dict) and tracking.get("uri") is not None:
        problems.append(Problem("tracking.uri", "set by the server's owner; remove it from the job"))
    if imports:  # never import what the policy refuses: check the schema, but do not compile the pipeline
        try:
            JobConfig.model_validate(raw)
        except ValidationError as exc:
            problems += [_problem(e, "", JobConfig) for e in exc.errors()]
        raise ConfigError(problems, "job")
    try:
        loaded = load_job(raw)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems, "job") from None
    for node in loaded.graph.nodes:
        if checkpoint_every is not None and node.every is not None and checkpoint_every % node.every:
            problems.append(
                Problem(
                    f"pipeline node {node.name!r}",
                    f"runs every {node.every} iterations, which does not divide the server's checkpoint_every "
                    f"({checkpoint_every}); a resumed job would evaluate out of phase: make it divide it",
                )
            )
    if problems:
        raise ConfigError(problems, "job")
    config = loaded.config.model_dump(mode="json")
    config["run_dir"] = str(Path(config["run_dir"]).resolve())
    return Accepted(loaded.config.name, config, loaded.config.iterations)


def _dotted_problems(value: Any, modules: list[str], where: str) -> list[Problem]:
    out: list[Problem] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _dotted_problems(v, modules, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _dotted_problems(v, modules, f"{where}[{i}]")
    elif isinstance(value, str):
        m = DOTTED.match(value)
        if m is not None:
            module = m.group(1)
            if not any(module == a or module.startswith(a + ".") for a in modules):
                out.append(
                    Problem(
                        where,
                        f"{value.strip()!r} names module {module!r}, outside this server's allowed modules "
                        f"{modules}; ask the server's owner to add it to `allowed_modules`",
                    )
                )
    return out


def _path_problem(value: Any, where: str, roots: list[Path]) -> list[Problem]:
    if not isinstance(value, str):
        return []  # the schema reports the type
    path = Path(value).resolve()
    if any(path == r or path.is_relative_to(r) for r in roots):
        return []
    shown = ", ".join(str(r) for r in roots)
    return [Problem(where, f"{value!r} resolves to {path}, outside the server's allowed roots ({shown})")]


__all__ = ["Accepted", "check_submission"]
