"""Hostile submissions against `check_submission` (what `POST /jobs` runs) and the YAML reader: every place a
string can reach an import, as plain strings, YAML tags, escapes, `--set` values and nested params; project
functions as payloads; paths and names after coercion. Each payload, if it ran, would import a module that
writes a marker file (or run a shell command that does): the marker must never appear, the module never
enter `sys.modules`, and the answer is always a `ConfigError` (the server's 400)."""

from __future__ import annotations

import base64
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TINY

from plexrl.errors import ConfigError
from plexrl.roles import allowed_modules, parse_ref, resolve
from plexrl.server.submissions import check_submission
from plexrl.yamlio import load_yaml_text

PAYLOAD = "evil_payload_zz"  # a module that, imported, writes the marker


@pytest.fixture
def arena(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    marker = tmp_path / "pwned"
    (tmp_path / f"{PAYLOAD}.py").write_text(
        f"with open({str(marker)!r}, 'w') as f:\n    f.write('imported')\n"
        "def build(**kw):\n    open(kw.get('path', 'x'), 'w').write('called')\n"
        "from plexrl import operator, pipeline_builder\n"
        "@pipeline_builder\ndef declared(**kw):\n    raise RuntimeError('must not be reached')\n"
    )
    (tmp_path / "buggy_user_mod.py").write_text("from . import nothing\n")  # TypeError/ImportError at import
    (tmp_path / "user_mod_ok.py").write_text(
        "from plexrl import pipeline_builder\n"
        "class Builder:\n    pass\n"
        "@pipeline_builder\ndef raises(**kw):\n    raise TypeError('bad builder')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    roots = [(tmp_path / "runs").resolve()]
    roots[0].mkdir()
    # what accepted jobs import (pydantic internals, the built-in pipelines), and the allowed project modules
    # that payloads name (with their dependencies): not the payloads' doing
    import plexrl.server.api  # noqa: F401

    for pipeline in ({}, {"pipeline": {"name": "grpo_tools"}}):
        text = yaml.safe_dump({**{k: v for k, v in TINY.items() if k != "run_dir"}, **pipeline})
        check_submission(text, [], run_dir=roots[0], roots=roots, modules=["plexrl"])
    yield {"marker": marker, "tmp": tmp_path, "roots": roots, "shell": f"touch {marker}"}
    sys.modules.pop(PAYLOAD, None)
    assert not marker.exists(), "a payload ran"


def submit(arena: dict[str, Any], text: str, sets: list[str] | None = None, modules: list[str] | None = None) -> str:
    """The problems of a refused submission, as text; fails the test if it is accepted."""
    before = set(sys.modules)
    with pytest.raises(ConfigError) as err:
        check_submission(
            text, sets or [], run_dir=arena["roots"][0], roots=arena["roots"], modules=modules or ["plexrl"]
        )
    new = set(sys.modules) - before
    assert PAYLOAD not in new and all(m.split(".")[0] in ("plexrl", "user_mod_ok") for m in new), new
    assert not arena["marker"].exists()
    return str(err.value)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


SHELL_PARAMS = "{args: [sh, -c, 'SHELL']}"


@pytest.mark.parametrize(
    "doc",
    [
        # the reported exploit: bytes hide the path from a str-only scan, then the schema makes it a str
        "pipeline:\n  name: !!binary {b64}\n  params: {shell}\n",
        "pipeline:\n  name: !!str subprocess:run\n  params: {shell}\n",
        "pipeline:\n  name: !!python/name:subprocess.run ''\n",
        "pipeline:\n  name: !!python/object/apply:subprocess.run [[sh, -c, 'SHELL']]\n",
        "pipeline:\n  name: !custom subprocess:run\n",
        "pipeline: !!map\n  name: subprocess:run\n",
        "pipeline:\n  name: ! subprocess:run\n",
        # plain strings and escapes that parse to the same path
        "pipeline:\n  name: subprocess:run\n  params: {shell}\n",
        'pipeline:\n  name: "subprocess\\x3arun"\n  params: {shell}\n',
        'pipeline:\n  name: "\\u0073ubprocess:run"\n  params: {shell}\n',
        "pipeline:\n  name: '  subprocess:run  '\n",
        f"pipeline:\n  name: {PAYLOAD}:build\n",
        f"pipeline:\n  name: {PAYLOAD}:declared\n",
        # other places a string reaches an import: operators, tools, nested params, lists
        f"pipeline:\n  nodes:\n    - {{name: a, op: '{PAYLOAD}:build'}}\n",
        "pipeline:\n  nodes:\n    - {name: a, op: !!binary " + b64(f"{PAYLOAD}:build") + "}\n",
        f"pipeline:\n  name: grpo_tools\n  params: {{tool: '{PAYLOAD}:build'}}\n",
        f"pipeline:\n  name: grpo_tools\n  params: {{tool: [{{x: '{PAYLOAD}:build'}}]}}\n",
        "pipeline:\n  name: grpo_tools\n  params: {tool: !!binary " + b64(f"{PAYLOAD}:build") + "}\n",
    ],
)
def test_no_payload_reaches_an_import(arena: dict[str, Any], doc: str) -> None:
    doc = doc.replace("{b64}", b64("subprocess:run")).replace("{shell}", SHELL_PARAMS)
    text = submit(arena, _merge(doc, arena))
    assert "tag" in text or "outside this server's allowed modules" in text, text


def _merge(doc: str, arena: dict[str, Any]) -> str:
    """TINY without its pipeline, plus the payload's pipeline section."""
    cfg = {k: v for k, v in TINY.items() if k not in ("run_dir", "pipeline")}
    return yaml.safe_dump(cfg) + doc.replace("SHELL", arena["shell"])


@pytest.mark.parametrize(
    "value",
    [
        "subprocess:run",
        f"{PAYLOAD}:build",
        "!!binary " + b64("subprocess:run"),
        "!!python/name:os.system ''",
        '"subprocess\\x3arun"',
        "{name: subprocess:run}",
    ],
)
def test_set_values_are_refused_too(arena: dict[str, Any], value: str) -> None:
    sets = [f"pipeline.name={value}", f"pipeline.params.args=[sh, -c, '{arena['shell']}']"]
    text = submit(arena, _merge("", arena), sets)
    assert "tag" in text or "outside this server's allowed modules" in text or "pipeline" in text, text


def test_project_functions_are_not_builders(arena: dict[str, Any]) -> None:
    secret = arena["tmp"] / "runs" / "secret.yaml"
    secret.write_text("token: the-owners-secret-value\n")
    cases = {
        # re-opening the allow-list from inside: a project function named as a builder
        "plexrl.server.submissions:check_submission": {
            "text": "{}",
            "overrides": [],
            "run_dir": "/",
            "roots": ["/"],
            "modules": [PAYLOAD],
        },
        # reading any file and echoing it in the 400
        "plexrl.yamlio:load_yaml_file": {"path": str(secret)},
        "plexrl.job.load:load_job": {"source": str(secret)},
        "plexrl.server.api:start_server": {},
    }
    for ref, params in cases.items():
        doc = yaml.safe_dump({"pipeline": {"name": ref, "params": params}})
        text = submit(arena, _merge(doc, arena))
        assert "is not a declared pipeline builder" in text, text
        assert "the-owners-secret-value" not in text
    # a project function named as an operator or a tool is refused the same way
    ops = yaml.safe_dump({"pipeline": {"nodes": [{"name": "a", "op": "plexrl.yamlio:load_yaml_file"}]}})
    assert "is not an operator" in submit(arena, _merge(ops, arena))
    tool = yaml.safe_dump({"pipeline": {"name": "grpo_tools", "params": {"tool": "plexrl.yamlio:load_yaml_file"}}})
    assert "is not a declared tool" in submit(arena, _merge(tool, arena))


def test_user_module_errors_are_problems_of_the_submission(arena: dict[str, Any]) -> None:
    modules = ["plexrl", "user_mod_ok", "buggy_user_mod"]
    for ref, expected in {
        "buggy_user_mod:build": "module 'buggy_user_mod'",
        "user_mod_ok:Builder": "is not a declared pipeline builder",
        "user_mod_ok:raises": "raised TypeError: bad builder",
    }.items():
        doc = yaml.safe_dump({"pipeline": {"name": ref}})
        text = submit(arena, _merge(doc, arena), modules=modules)
        assert expected in text, text


def test_names_are_matched_whole(arena: dict[str, Any]) -> None:
    for name in ("nl\n", "a\nb", "x" * 65, "../up", "-x", "tab\t", "٣digits"):
        doc = yaml.safe_dump({**{k: v for k, v in TINY.items() if k != "run_dir"}, "name": name})
        assert "- name:" in submit(arena, doc), name


def test_paths_are_checked_after_coercion_and_say_nothing_about_existence(arena: dict[str, Any]) -> None:
    outside = arena["tmp"] / "elsewhere"
    (outside / "model").mkdir(parents=True)
    (outside / "model" / "config.json").write_text("{}")
    base = {k: v for k, v in TINY.items() if k != "run_dir"}
    # as tags (refused by the reader) and as plain values (refused by the policy), never created
    tagged = yaml.safe_dump(base) + "run_dir: !!binary " + b64(str(outside / "cache")) + "\n"
    assert "the tag 'tag:yaml.org,2002:binary' on line" in submit(arena, tagged)
    assert "- run_dir:" in submit(arena, yaml.safe_dump({**base, "run_dir": str(outside / "cache")}))
    assert not (outside / "cache").exists()
    link = arena["roots"][0] / "link"
    link.symlink_to(outside)
    assert "outside the server's allowed roots" in submit(arena, yaml.safe_dump({**base, "run_dir": str(link)}))

    def answer(path: Path) -> str:
        doc = yaml.safe_dump({**base, "model": {**base["model"], "path": str(path)}})
        return submit(arena, doc).replace(str(path), "PATH")

    # one model directory exists (with a config.json), the other does not: the same answer
    assert answer(outside / "model") == answer(outside / "missing")
    assert "config.json" not in answer(outside / "model")


def test_the_reader_refuses_every_tag_and_keeps_plain_values() -> None:
    tagged = ["a: !!binary eA==", "a: !!set {x}", "a: !!omap [{x: 1}]", "a: !!timestamp 2001-01-01", "a: !x 1"]
    tagged += ["a: ! 1", "!!map {a: 1}", "a: [!!int '3']", "%TAG !e! tag:e.com,2000:\n---\na: !e!x 1"]
    for doc in tagged:
        with pytest.raises(ConfigError, match="tag"):
            load_yaml_text(doc, "doc")
    assert load_yaml_text("a: &x [1, 'b', {c: null}]\nb: *x\nd: {<<: {e: 1.5}}\n", "doc") == {
        "a": [1, "b", {"c": None}],
        "b": [1, "b", {"c": None}],
        "d": {"e": 1.5},
    }


def test_resolve_checks_the_allow_list_before_importing(arena: dict[str, Any]) -> None:
    assert parse_ref(f"{PAYLOAD}:build") == (PAYLOAD, "build")
    with allowed_modules(["plexrl"]), pytest.raises(LookupError, match="outside the allowed modules"):
        resolve(f"{PAYLOAD}:declared", "pipeline")
    assert PAYLOAD not in sys.modules
    # allowed: imported (the marker appears), but an undeclared function is still refused
    with allowed_modules([PAYLOAD]), pytest.raises(LookupError, match="is not a declared pipeline builder"):
        resolve(f"{PAYLOAD}:build", "pipeline")
    assert arena["marker"].exists()
    arena["marker"].unlink()
    with pytest.raises(LookupError, match="not a dotted path"):
        resolve("subprocess : run", "pipeline")


def test_roles_doctests() -> None:
    import doctest

    import plexrl.roles

    result = doctest.testmod(plexrl.roles)
    assert result.attempted > 0 and result.failed == 0
