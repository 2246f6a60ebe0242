"""Loading a job: `load_job(path, overrides)` reads a YAML job, applies `--set key=value` overrides, validates
it (`plexrl.job.config.JobConfig`) and compiles its pipeline, runs the job's checks (`plexrl.job.checks`), and
raises one `ConfigError` listing every problem (unknown keys, wrong types, values out of range, a missing file,
and all pipeline problems) so a user fixes them in one pass. YAML is read through `plexrl.yamlio` (bounded
time and memory; duplicate keys, alias bombs, deep nesting, huge integers and non-UTF-8 files are errors).
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, ValidationError, validate_call

from plexrl.errors import ConfigError, Problem, pydantic_problem
from plexrl.graph import NodeSpec, PipelineGraph, compile_pipeline
from plexrl.job.checks import budget_problems, chunk_problems, lora_problems, slice_problems, vllm_problem
from plexrl.job.config import JobConfig, PipelineConfig
from plexrl.roles import resolve
from plexrl.yamlio import load_yaml_file, load_yaml_text

BUILTIN_PIPELINES: dict[str, str] = {
    name: f"plexrl.pipelines.{name}:{name}"
    for name in ("grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "gspo", "ppo", "grpo_tools")
}


@dataclass(slots=True)
class LoadedJob:
    """A validated config, its compiled pipeline, and the raw dict it came from (saved as an artifact)."""

    config: JobConfig
    graph: PipelineGraph
    raw: dict[str, Any]
    source: str


def build_pipeline(cfg: PipelineConfig, where: str = "pipeline") -> PipelineGraph:
    """Compile a pipeline config (named builder or explicit nodes); raises `ConfigError`."""
    if cfg.nodes is not None:
        specs = [NodeSpec(n.name, n.op, n.params, n.inputs, n.after, n.every) for n in cfg.nodes]
        return compile_pipeline("custom", specs, where)
    assert cfg.name is not None
    ref = BUILTIN_PIPELINES.get(cfg.name, cfg.name)
    if ":" not in ref:
        close = difflib.get_close_matches(cfg.name, BUILTIN_PIPELINES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            [
                Problem(
                    f"{where}.name",
                    f"unknown pipeline {cfg.name!r}{hint}; built-in: "
                    f"{', '.join(BUILTIN_PIPELINES)}, or a dotted path 'pkg.module:builder'",
                )
            ]
        )
    try:
        # declared builders only, in an allowed module (plexrl.roles)
        builder = resolve(ref, "pipeline", builtin=cfg.name in BUILTIN_PIPELINES)
    except LookupError as exc:
        raise ConfigError([Problem(f"{where}.name", f"cannot load pipeline builder: {exc}")]) from None
    try:
        graph = validate_call(config=ConfigDict(extra="forbid"))(builder)(**cfg.params)
    except ValidationError as exc:
        raise ConfigError([pydantic_problem(e, f"{where}.params", None) for e in exc.errors()]) from None
    except ConfigError as exc:
        raise _named(exc, cfg.name) from None
    except Exception as exc:  # a user's builder with a bug: a problem of this config, not a server error
        raise ConfigError(
            [Problem(f"{where}.name", f"pipeline builder {ref!r} raised {type(exc).__name__}: {exc}")]
        ) from None
    if not isinstance(graph, PipelineGraph):
        raise ConfigError([Problem(f"{where}.name", f"builder {ref!r} must return a PipelineGraph")])
    return graph


def _named(exc: ConfigError, name: str) -> ConfigError:
    hint = f" (node built by pipeline {name!r}: set its parameters under pipeline.params)"
    return ConfigError([Problem(p.where, p.message + hint) for p in exc.problems], exc.source)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> list[Problem]:
    """Apply `a.b.c=value` overrides in place (value parsed as YAML); return problems with malformed ones."""
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(Problem(f"--set {item}", "expected key=value, e.g. --set iterations=10"))
            continue
        target: Any = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(target.get(part, {}), dict):
                problems.append(Problem(f"--set {item}", f"{part!r} is not a mapping; cannot set {key!r}"))
                break
            target = target.setdefault(part, {})
        else:
            try:
                target[parts[-1]] = load_yaml_text(value, f"--set {item}")
            except ConfigError as exc:
                problems += [Problem(p.where, f"{p.message}; quote strings") for p in exc.problems]
    return problems


def load_job(
    source: str | Path | dict[str, Any] | None, overrides: list[str] | None = None, *, parsed: Any = None
) -> LoadedJob:
    """Read, override, validate and compile a job. `source` is a YAML path, a dict, or None (defaults).
    `parsed`: the YAML of the path `source` already parsed (`config_kinds.read_config`: a file is parsed once)."""
    problems: list[Problem] = []
    name = "defaults"
    raw: dict[str, Any] = {}
    if isinstance(source, dict):
        raw, name = copy.deepcopy(source), "config"
    elif source is not None:
        path, name = Path(source), str(source)
        loaded = copy.deepcopy(parsed) if parsed is not None else load_yaml_file(path)  # bounded: plexrl.yamlio
        loaded = loaded or {}
        if not isinstance(loaded, dict):
            raise ConfigError([Problem(str(path), "a job config must be a YAML mapping of keys to values")], name)
        raw = loaded
    problems += apply_overrides(raw, overrides or [])
    config: JobConfig | None = None
    try:
        config = JobConfig.model_validate(raw)
    except ValidationError as exc:
        problems += [pydantic_problem(e, "", JobConfig) for e in exc.errors()]
    graph = None
    if config is not None or not any(p.where.startswith("pipeline") for p in problems):
        try:
            pcfg = config.pipeline if config else PipelineConfig.model_validate(raw.get("pipeline", {"name": "grpo"}))
            graph = build_pipeline(pcfg)
        except ConfigError as exc:
            problems += exc.problems
        except ValidationError:
            pass
    if config is not None and graph is not None:
        problems += chunk_problems(config.chunks, graph) + budget_problems(config, graph)
        problems += slice_problems(config.slices, graph)
    if config is not None and config.model.path is not None and not (Path(config.model.path) / "config.json").is_file():
        problems.append(
            Problem(
                "model.path",
                f"{config.model.path} is not a saved HF model directory (no config.json); "
                "point it at one, or remove model.path to build a model locally",
            )
        )
    if config is not None and config.model.lora is not None:
        problems += lora_problems(config, graph)
    if config is not None and config.engine == "vllm" and not any(p.where.startswith("model") for p in problems):
        why = vllm_problem(config.model)
        if why:
            problems.append(Problem("engine", f"{why}; or set `engine: torch` (or auto)"))
    if problems or config is None or graph is None:
        raise ConfigError(problems, name)
    return LoadedJob(config, graph, raw, name)


__all__ = ["BUILTIN_PIPELINES", "LoadedJob", "apply_overrides", "build_pipeline", "load_job"]
