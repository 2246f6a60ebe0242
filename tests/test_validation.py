"""Every validation error names the node or field and says what to do; all are reported at once."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from conftest import shipped_data

from plexrl.batch import Rewards, Rollouts
from plexrl.config_kinds import check_config
from plexrl.errors import ConfigError
from plexrl.graph import NodeSpec, Pipeline, compile_pipeline
from plexrl.job.load import load_job

NODES: list[dict[str, Any]] = [
    {"name": "prompts", "op": "sample_prompts", "params": {"batch_size": 4}},
    {"name": "rollout", "op": "rollout", "inputs": {"prompts": "prompts"}, "params": {"n": 2}},
    {"name": "verify", "op": "verify", "inputs": {"rollouts": "rollout"}},
    {"name": "advantage", "op": "grpo_advantage", "inputs": {"rollouts": "rollout", "rewards": "verify"}},
    {"name": "train", "op": "train", "inputs": {"rollouts": "rollout", "advantages": "advantage"}},
]


def explicit(mutate: Any = None) -> dict[str, Any]:
    nodes = copy.deepcopy(NODES)
    if mutate:
        mutate(nodes)
    return {"pipeline": {"nodes": nodes}}


def problems_of(cfg: dict[str, Any] | str | Path) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_job(cfg)
    return [str(p) for p in info.value.problems]


def test_explicit_pipeline_is_valid_and_matches_builder() -> None:
    loaded = load_job(explicit())
    assert loaded.graph.order == ["prompts", "rollout", "verify", "advantage", "train"]
    p = Pipeline("x")
    pr = p.add("prompts", "sample_prompts", batch_size=4)
    r = p.add("rollout", "rollout", prompts=pr, n=2)
    v = p.add("verify", "verify", rollouts=r)
    a = p.add("advantage", "grpo_advantage", rollouts=r, rewards=v)
    p.add("train", "train", rollouts=r, advantages=a)
    built = p.build()
    assert built.describe() == loaded.graph.describe()
    assert sorted(built.graph.edges(data="port")) == sorted(loaded.graph.graph.edges(data="port"))


def test_cycle() -> None:
    def mutate(nodes: list[dict[str, Any]]) -> None:
        nodes[0]["after"] = ["train"]

    (msg,) = problems_of(explicit(mutate))
    assert "cycle" in msg and "prompts" in msg and "train" in msg and "remove one of these edges" in msg


def test_unknown_operator_suggests_a_name() -> None:
    (msg,) = problems_of(explicit(lambda n: n[2].update(op="verfy")))
    assert "nodes[2] ('verify').op" in msg and "unknown operator 'verfy'" in msg and "did you mean 'verify'" in msg


def test_missing_input() -> None:
    msgs = problems_of(explicit(lambda n: n[4]["inputs"].pop("advantages")))
    assert any("missing input 'advantages'" in m and "'train'" in m and "Advantages" in m for m in msgs)


def test_unknown_input_port_and_unknown_source() -> None:
    def mutate(nodes: list[dict[str, Any]]) -> None:
        nodes[2]["inputs"]["bogus"] = "rollout"
        nodes[3]["inputs"]["rewards"] = "verifier"

    msgs = problems_of(explicit(mutate))
    assert any("has no input 'bogus'" in m and "its inputs: rollouts" in m for m in msgs)
    assert any("unknown node 'verifier'" in m for m in msgs)


def test_type_mismatch() -> None:
    (msg,) = problems_of(explicit(lambda n: n[4]["inputs"].update(advantages="verify")))
    assert "outputs Rewards" in msg and "expects Advantages" in msg and "('train').inputs.advantages" in msg


def test_duplicate_node_name() -> None:
    msgs = problems_of(explicit(lambda n: n.append(dict(n[2]))))
    assert any("duplicate node name 'verify'" in m for m in msgs)


def test_parameter_wrong_type_and_out_of_range() -> None:
    def mutate(nodes: list[dict[str, Any]]) -> None:
        nodes[1]["params"] = {"n": "many", "temperature": -1.0}
        nodes[4]["params"] = {"lrr": 0.1}

    msgs = problems_of(explicit(mutate))
    assert any("('rollout').params.n" in m and "integer" in m for m in msgs)
    assert any("('rollout').params.temperature" in m and "greater than 0" in m for m in msgs)
    assert any("('train').params.lrr" in m and "unknown parameter" in m and "lr" in m for m in msgs)


def test_unknown_yaml_key_and_bad_values_reported_together() -> None:
    msgs = problems_of({"iterations": 0, "modle": {}, "model": {"hidden": 30, "heads": 4}, "task": {"digits": "x"}})
    joined = "\n".join(msgs)
    assert "modle: unknown key" in joined and "did you mean 'model'" in joined
    assert "iterations" in joined and "greater than or equal to 1" in joined
    assert "divisible by heads" in joined
    assert "task.digits" in joined
    assert len(msgs) == 4


def test_unknown_key_inside_node_names_known_keys() -> None:
    msgs = problems_of(explicit(lambda n: n[0].update(parms={})))
    assert any("pipeline.nodes.0.parms" in m and "did you mean 'params'" in m for m in msgs)


def test_missing_file(tmp_path: Path) -> None:
    (msg,) = problems_of(tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "file not found" in msg


def test_named_pipeline_bad_params_and_unknown_name() -> None:
    msgs = problems_of({"pipeline": {"name": "grpo", "params": {"n": "x", "bogus": 1}}})
    assert any("pipeline.params.n" in m for m in msgs) and any("pipeline.params.bogus" in m for m in msgs)
    (msg,) = problems_of({"pipeline": {"name": "grop"}})
    assert "unknown pipeline 'grop'" in msg and "did you mean 'grpo'" in msg


def test_all_errors_at_once_across_config_and_pipeline() -> None:
    cfg = explicit(lambda n: n[2].update(op="nope"))
    cfg["seed"] = "abc"
    msgs = problems_of(cfg)
    assert any(m.startswith("seed") for m in msgs) and any("unknown operator 'nope'" in m for m in msgs)


def test_periodic_node_feeding_every_iteration_node_is_refused() -> None:
    specs = [NodeSpec(**n) for n in copy.deepcopy(NODES)]
    specs[2].every = 3
    with pytest.raises(ConfigError, match="runs only every 3 iterations"):
        compile_pipeline("p", specs)


def test_user_operator_by_dotted_path_from_yaml(tmp_path: Path) -> None:
    text = """
pipeline:
  nodes:
    - {name: prompts, op: sample_prompts}
    - {name: rollout, op: rollout, inputs: {prompts: prompts}}
    - {name: verify, op: verify, inputs: {rollouts: rollout}}
    - name: shaped
      op: user_ops:length_penalty
      params: {per_token: 0.05}
      inputs: {rollouts: rollout, rewards: verify}
    - {name: advantage, op: grpo_advantage, inputs: {rollouts: rollout, rewards: shaped}}
    - {name: train, op: train, inputs: {rollouts: rollout, advantages: advantage}}
"""
    path = tmp_path / "job.yaml"
    path.write_text(text)
    loaded = load_job(path)
    node = loaded.graph.node("shaped")
    assert node.operator.ref == "user_ops:length_penalty" and node.runs_on == "cpu"
    assert node.params.model_dump() == {"per_token": 0.05}
    path.write_text(text.replace("user_ops:length_penalty", "user_ops:not_an_operator"))
    (msg,) = problems_of(path)
    assert "is not an operator" in msg and "@plexrl.operator" in msg
    path.write_text(text.replace("user_ops:length_penalty", "no_such_pkg.ops:x"))
    (msg,) = problems_of(path)
    assert "cannot import module 'no_such_pkg.ops'" in msg


def test_the_former_placement_keyword_of_operator_is_refused_naming_runs_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a node runs is `runs_on`; "placement" is where a job goes. An operator still declared with
    `placement=` fails where it is declared, and a job naming it gets that error with the fix."""
    from plexrl.operator import operator

    def score(rollouts: Rollouts, rewards: Rewards) -> Rewards: ...

    with pytest.raises(TypeError, match=r"@operator\(placement='cpu'\) is now @operator\(runs_on='cpu'\)"):
        operator(placement="cpu")(score)
    with pytest.raises(TypeError, match="needs runs_on='service'"):
        operator()(score)
    assert operator(runs_on="cpu")(score).runs_on == "cpu" and operator("service")(score).runs_on == "service"
    (tmp_path / "old_ops.py").write_text(
        "from plexrl import operator\nfrom plexrl.batch import Rewards\n\n\n"
        '@operator(placement="cpu")\ndef same(rewards: Rewards) -> Rewards:\n    return rewards\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    node = {"name": "same", "op": "old_ops:same", "inputs": {"rewards": "verify"}}
    msgs = problems_of(explicit(lambda nodes: nodes.insert(3, node)))
    assert any("old_ops" in m and "is now @operator(runs_on='cpu')" in m for m in msgs), msgs


def test_every_shipped_yaml_validates(tmp_path: Path) -> None:
    configs = sorted(Path(__file__).parents[1].glob("configs/**/*.yaml"))
    assert configs, "configs/ must hold at least one job"
    for path in configs:
        first = path.read_text().splitlines()[0]
        assert first.startswith("#") and "plexrl" in first, f"{path} must open with the command that runs it"
        check_config(
            path, shipped_data(path, tmp_path / path.stem)
        )  # its kind's own loader (`plexrl validate`; the simulator's too)


def test_main_job_yaml_equals_embedded_defaults() -> None:
    path = Path(__file__).parents[1] / "configs" / "grpo_arithmetic.yaml"
    from_yaml, defaults = load_job(path), load_job(None)
    assert from_yaml.config.model_dump(exclude={"pipeline"}) == defaults.config.model_dump(exclude={"pipeline"})
    assert from_yaml.graph.describe() == defaults.graph.describe()  # the YAML spells out grpo's defaults


def test_remote_verifier_is_a_cpu_node_with_a_validated_latency() -> None:
    graph = load_job({"pipeline": {"name": "grpo", "params": {"verifier_latency_s": 0.3}}}).graph
    node = graph.node("verify")
    assert node.operator.name == "remote_verify" and node.runs_on == "cpu"
    assert node.params.model_dump()["latency_s"] == 0.3
    with pytest.raises(ConfigError, match="verifier_latency_s"):
        load_job({"pipeline": {"name": "grpo", "params": {"verifier_latency_s": -1}}})
    nodes = [
        {"name": "prompts", "op": "sample_prompts"},
        {"name": "v", "op": "remote_verify", "params": {"latency_s": -0.5}, "inputs": {"rollouts": "prompts"}},
    ]
    with pytest.raises(ConfigError, match="latency_s"):
        load_job({"pipeline": {"nodes": nodes}})
