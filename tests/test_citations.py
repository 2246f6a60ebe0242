"""The repository explains itself: every file that code, configs or docs cite is in the repository, and nothing
points outside it.

Scanned: every *.py, *.md, *.yaml, *.yml, *.sh and Makefile of the repository (not .venv, .git, run outputs or
build folders). A citation is
- a path with a directory and a known extension (.py, .md, .yaml, .yml, .sh, .toml) whose first part is a
  top-level folder of the repository (`docs/`, `plexrl/`, `configs/`, ...), or a subpackage of plexrl cited
  from inside the package's own prose (`services/swap.py` means plexrl/services/swap.py);
- a relative path that climbs (`../x`): it must stay inside the repository;
- a root document in capitals (`README.md`, `DEVELOPERS.md`): it must be at the root;
- the target of a Markdown link (`[text](guide.md)`), relative to the page.
Each must exist, as a file or as a glob that matches one (`tests/test_planner*.py`). Paths under `runs/` and
`build/` are outputs of a run, and placeholders (`<run_dir>/...`, `$OUT/...`, a part in capitals:
`configs/sim/NAME.yaml`) stand for the reader's own files: neither is a citation.

Also refused anywhere: a machine path (into the machine's own `work` folder), the `shared` folder beside a
checkout, and issue numbers: a page or a comment says what a feature does and how it was measured, not which
ticket asked for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh"}
SKIP_DIRS = {".git", ".venv", "runs", "build", "dist", "mlruns", "mlartifacts", "node_modules", "__pycache__"}
OUTPUTS = ("runs/", "build/")
EXTENSIONS = r"(?:py|md|yaml|yml|sh|toml)"

# a path-like token: optional leading ../ parts, then name/name/... ending in a known extension
PATH = re.compile(r"(?<![\w./~$<{-])((?:\.\./)*[\w*.-]+(?:/[\w*.-]+)+\." + EXTENSIONS + r")(?![\w/])")
ROOT_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z_]+\.md)\b")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$")  # NAME, JOB.yaml: the reader's own file
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# spelled in pieces so that this file does not match itself
FORBIDDEN = [
    (re.compile("/" + r"work/"), "a machine path"),
    (re.compile(r"\.\./" + "shared"), "a folder outside the repository"),
    (re.compile(r"\b[Ii]ssues? #?[0-9]+\b"), "an issue number (say what the feature does instead)"),
]


def _files() -> Iterator[Path]:
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in SUFFIXES or path.name == "Makefile"):
            yield path


FILES = list(_files())
TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and p.name not in SKIP_DIRS and not p.name.startswith(".")}
SUBPACKAGES = {p.name for p in (ROOT / "plexrl").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def _exists(target: str, base: Path) -> bool:
    """Whether `target` (a path or a glob) names a file or folder, from `base`."""
    if any(ch in target for ch in "*?["):
        return any(base.glob(target))
    return (base / target).exists()


def _inside(path: Path) -> bool:
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return False
    return True


def _check_path(token: str, source: Path) -> str | None:
    """Why the path `token` cited in `source` is broken, or None (fine, or not a citation)."""
    if token.startswith("../"):
        if not _inside(source.parent / token):
            return "points outside the repository"
        return None if _exists(token, source.parent) else "not found"
    if token.startswith(OUTPUTS) or any(PLACEHOLDER.match(part) for part in token.split("/")):
        return None
    first = token.split("/", 1)[0]
    if first in TOP:
        return None if _exists(token, ROOT) else "not found"
    in_package = source.relative_to(ROOT).parts[0] in ("plexrl", "docs") or source.name.endswith(".md")
    if first in SUBPACKAGES and in_package:
        return None if _exists(token, ROOT / "plexrl") or _exists(token, ROOT) else "not found"
    return None  # an example of the user's own (`mypkg/ops.py`), not a file of ours


def _problems(path: Path, text: str | None = None) -> list[str]:
    """What is wrong with the citations of `path` (its `text`, read when None)."""
    if text is None:
        text = path.read_text(encoding="utf-8", errors="replace")
    rel = path.relative_to(ROOT)
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern, what in FORBIDDEN:
            if pattern.search(line):
                found.append(f"{rel}:{lineno}: {what}: {line.strip()[:100]}")
        for m in PATH.finditer(line):
            why = _check_path(m.group(1), path)
            if why:
                found.append(f"{rel}:{lineno}: cites {m.group(1)}: {why}")
        for m in ROOT_DOC.finditer(line):
            if not (ROOT / m.group(1)).is_file():
                found.append(f"{rel}:{lineno}: cites {m.group(1)}: no such file at the root of the repository")
        if path.suffix == ".md":
            for m in MD_LINK.finditer(line):
                target = m.group(1)
                if re.match(r"^[a-z]+:", target) or target.startswith(OUTPUTS):
                    continue
                if not _inside(path.parent / target) or not _exists(target, path.parent):
                    found.append(f"{rel}:{lineno}: links to {target}: not in the repository")
    return found


def test_the_scan_sees_the_repository() -> None:
    """The scan itself: it finds the docs, the code and the configs (a scan of nothing passes anything)."""
    names = {str(p.relative_to(ROOT)) for p in FILES}
    assert {"README.md", "docs/architecture.md", "plexrl/accounting.py", "benchmarks/gpu_check.sh"} <= names
    assert "Makefile" in names and any(n.startswith("configs/") for n in names)
    assert {"docs", "plexrl", "configs", "benchmarks"} <= TOP and {"planner", "services"} <= SUBPACKAGES


@pytest.mark.parametrize(
    ("line", "source", "broken"),
    [
        ("see docs/architecture.md", "plexrl/accounting.py", False),
        ("see docs/" + "nowhere.md", "plexrl/accounting.py", True),
        ("tests in tests/test_planner*.py", "docs/guide.md", False),
        ("swaps: services/swap.py", "docs/architecture.md", False),
        ("swaps: services/" + "nowhere.py", "docs/architecture.md", True),
        ("the design: " + "DESIGN" + ".md", "plexrl/engines/base.py", True),
        ("the target design is ../" + "shared/DESIGN.md", "docs/architecture.md", True),
        ("one level up: ../.." + "/elsewhere/NOTES.md", "docs/architecture.md", True),
        ("the page's sibling: ../README.md", "docs/gpu.md", False),
        ("a lock: flock /" + "work/notes/heavy.lock", "benchmarks/multiplex.py", True),
        ("(" + "iss" + "ue 14)", "docs/benchmarks.md", True),
        ("written to runs/clusters/x/report.txt or build/out/summary.yaml", "docs/guide.md", False),
        ("a user's own mypkg/ops.py", "docs/guide.md", False),
        ("any of configs/sim/NAME.yaml", "plexrl/sim/config.py", False),
        ("[the guide](guide.md#the-command-line)", "docs/gpu.md", False),
        ("[gone](gone.md)", "docs/gpu.md", True),
    ],
)
def test_the_rules_catch_what_they_should(line: str, source: str, broken: bool) -> None:
    """Each rule on one line, as if written in `source` (the rules depend on where it is)."""
    problems = _problems(ROOT / source, line + "\n")
    assert bool(problems) is broken, problems


def test_every_citation_points_at_a_file_in_the_repository() -> None:
    problems = [p for path in FILES for p in _problems(path)]
    assert not problems, "\n".join(["cited but not in the repository, or pointing outside it:", *problems])
