"""`plexrl validate` knows every config kind: it detects the kind and checks with that kind's model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import shipped_data
from typer.testing import CliRunner

from plexrl.cli import app
from plexrl.config_kinds import RUNS, check_config, detect_kind, read_config
from plexrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))
runner = CliRunner()


def expected_kind(path: Path) -> str:
    if path.name == "profiles.yaml":
        return "profiles"
    if path.parent.name == "sim":
        return "trace" if path.name.startswith("trace") else "scenario"
    return "cluster" if "jobs:" in path.read_text() else "job"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_validates_as_its_kind(path: Path, tmp_path: Path) -> None:
    sets = [arg for value in shipped_data(path, tmp_path) for arg in ("--set", value)]
    result = runner.invoke(app, ["validate", str(path), *sets])
    assert result.exit_code == 0, result.output
    assert f"OK, a {expected_kind(path)} config" in result.output
    assert "problem" not in result.output


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_plexrl_run_and_validate_agree_on_the_kind_of_every_shipped_config(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`plexrl run` reads a file once and detects its kind as `plexrl validate` does: a job goes to the job
    runner, a cluster to the cluster runner (stopped here before anything runs), any other kind is refused
    naming the command that runs it. (Before: `run` took any file with a `jobs` key for a cluster, so a
    simulator trace, with its `jobs: 100`, failed as a broken cluster config.)"""
    import plexrl.cluster
    import plexrl.runtime.jobs

    ran: list[str] = []

    def stop(kind: str):  # type: ignore[no-untyped-def]
        def runner(*args: object, **kwargs: object) -> None:
            ran.append(kind)
            raise KeyboardInterrupt  # the CLI's own way out: exit 130, nothing ran

        return runner

    monkeypatch.setattr(plexrl.runtime.jobs, "run_jobs", stop("job"))
    monkeypatch.setattr(plexrl.cluster, "run_cluster", stop("cluster"))
    kind = check_config(path, shipped_data(path, tmp_path)).kind
    assert read_config(path).kind == kind
    result = runner.invoke(app, ["run", str(path)])
    if kind in ("job", "cluster"):
        assert ran == [kind] and result.exit_code == 130, result.output
    else:
        assert ran == [] and result.exit_code == 2, result.output
        assert f"a {kind} config" in result.output and f"use `{RUNS[kind]}`" in result.output


def test_the_simulator_scenario_no_longer_reports_job_problems() -> None:
    checked = check_config(ROOT / "configs" / "sim" / "qwen25_7b.yaml")
    assert checked.kind == "scenario" and checked.why == "kind: scenario"
    assert "qwen2.5-7b" in checked.lines[0] and "plexrl-shared" in checked.lines[0]


def write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def sim_raw(name: str) -> dict[str, object]:
    raw = yaml.safe_load((ROOT / "configs" / "sim" / name).read_text())
    assert isinstance(raw, dict)
    return raw


def broken(tmp_path: Path) -> dict[str, Path]:
    job = {"iterations": -1, "pipeline": {"name": "grpo"}}
    cluster = {"jobs": [{"config": str(ROOT / "configs" / "grpo_arithmetic.yaml")}], "placement": "everywhere"}
    server = {"host": "127.0.0.1", "port": 99999, "journal": "j.db"}
    scenario = {**sim_raw("qwen25_7b.yaml"), "rollout_accelerators": 0}
    trace = {**sim_raw("trace_3months.yaml"), "days": -3}
    profiles = sim_raw("profiles.yaml")
    profiles["accelerators"] = {"bad": {**profiles["accelerators"]["h100"], "peak_tflops": "fast"}}  # type: ignore[index]
    return {
        kind: write(tmp_path, f"{kind}.yaml", raw)
        for kind, raw in {
            "job": job,
            "cluster": cluster,
            "server": server,
            "scenario": scenario,
            "trace": trace,
            "profiles": profiles,
        }.items()
    }


@pytest.mark.parametrize(
    ("kind", "where"),
    [
        ("job", "iterations"),
        ("cluster", "placement"),
        ("server", "port"),
        ("scenario", "rollout_accelerators"),
        ("trace", "days"),
        ("profiles", "accelerators.bad.peak_tflops"),
    ],
)
def test_a_broken_config_of_each_kind_names_its_problem(tmp_path: Path, kind: str, where: str) -> None:
    path = broken(tmp_path)[kind]
    raw = yaml.safe_load(path.read_text())
    assert detect_kind(raw)[0] == kind
    with pytest.raises(ConfigError) as err:
        check_config(path)
    assert [p.where for p in err.value.problems] == [where], err.value.problems
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and where in result.output and "Traceback" not in result.output


def test_a_server_config_is_recognised_by_its_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path, "server.yaml", {"port": 0, "journal": str(tmp_path / "j.db"), "cluster": {"ordering": "fifo"}}
    )
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output
    assert "OK, a server config" in result.output and "ordering fifo" in result.output


def test_a_trace_without_kind_is_recognised_by_its_keys() -> None:
    raw = sim_raw("trace_3months.yaml")
    del raw["kind"]
    assert detect_kind(raw)[0] == "trace"


def test_a_kind_that_names_no_kind_is_a_clear_error(tmp_path: Path) -> None:
    path = write(tmp_path, "odd.yaml", {"kind": "cluster", "jobs": []})
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2
    assert "kind: 'cluster'" in result.output and "remove the `kind:` line" in result.output


def test_set_overrides_reach_a_simulator_config() -> None:
    path = ROOT / "configs" / "sim" / "trace_3months.yaml"
    assert "20 jobs" in check_config(path, ["jobs=20"]).lines[0]
    with pytest.raises(ConfigError, match="jobs"):
        check_config(path, ["jobs=0"])


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "file not found" in result.output
