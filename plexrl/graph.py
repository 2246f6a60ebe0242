"""Pipelines: one RLVR iteration as a DAG of operator nodes.

The Python builder (`Pipeline`) and YAML (`pipeline.nodes` in a job config) both produce a list of
`NodeSpec`s that `compile_pipeline` checks and turns into one `PipelineGraph` (a networkx DiGraph whose
edges carry the input port they feed). Every problem is collected and raised together as a `ConfigError`:
duplicate names, unknown operators, bad parameters, unknown or missing inputs, type mismatches, cycles.

    p = Pipeline("grpo")
    prompts = p.add("prompts", "sample_prompts", batch_size=32)
    rollout = p.add("rollout", "rollout", prompts=prompts, n=8)
    ...
    graph = p.build()

This module does not run anything; the runtime does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from pydantic import BaseModel

from plexrl.errors import ConfigError, Problem
from plexrl.operator import Operator, RunsOn, resolve_operator


@dataclass(frozen=True, slots=True)
class NodeRef:
    """Handle returned by `Pipeline.add`; pass it as an input of a later node."""

    name: str


@dataclass(slots=True)
class NodeSpec:
    """An unchecked node: operator reference, raw params, `inputs` (port -> source node), extra ordering
    edges `after`, and `every` (run only on iterations i with (i+1) % every == 0, and on the last)."""

    name: str
    op: str | Operator
    params: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    after: list[str] = field(default_factory=list)
    every: int | None = None


@dataclass(slots=True)
class Node:
    """A checked node of a `PipelineGraph`."""

    name: str
    operator: Operator
    params: BaseModel
    inputs: dict[str, str]
    after: list[str]
    every: int | None

    @property
    def runs_on(self) -> RunsOn:
        return self.operator.runs_on

    def active(self, iteration: int, iterations: int) -> bool:
        """Whether this node runs in `iteration` (0-based) of a job with `iterations` iterations."""
        return self.every is None or (iteration + 1) % self.every == 0 or iteration == iterations - 1


class PipelineGraph:
    """A validated DAG of nodes. `graph` is a networkx DiGraph; node attribute `node` holds the `Node`,
    edge attribute `port` the input port an edge feeds (None for ordering-only edges)."""

    def __init__(self, name: str, graph: nx.DiGraph) -> None:
        self.name = name
        self.graph = graph
        self.order: list[str] = list(nx.lexicographical_topological_sort(graph))

    def node(self, name: str) -> Node:
        node: Node = self.graph.nodes[name]["node"]
        return node

    @property
    def nodes(self) -> list[Node]:
        """Nodes in a deterministic topological order."""
        return [self.node(n) for n in self.order]

    def deps(self, name: str) -> list[str]:
        return sorted(self.graph.predecessors(name))

    def uses_operator(self, op_name: str) -> bool:
        return any(n.operator.name == op_name for n in self.nodes)

    def describe(self) -> list[dict[str, Any]]:
        """A plain description (for logs, MLflow and `plexrl validate`). A parameter that is itself a model (a
        part of `train`'s objective) shows the fields it was given: the rest come from elsewhere (its preset)."""
        return [
            {
                "name": n.name,
                "op": n.operator.ref,
                "runs_on": n.runs_on,
                "inputs": dict(n.inputs),
                "params": _plain(n.params),
                **({"every": n.every} if n.every else {}),
            }
            for n in self.nodes
        ]

    def __repr__(self) -> str:
        return f"PipelineGraph({self.name!r}, nodes={self.order})"


def _plain(params: BaseModel) -> dict[str, Any]:
    """A node's parameters as plain values; a nested model as the fields it was given."""
    out = params.model_dump()
    for name in type(params).model_fields:
        value = getattr(params, name)
        if isinstance(value, BaseModel):
            out[name] = value.model_dump(exclude_unset=True)
    return out


class Pipeline:
    """Builder for a `PipelineGraph`. Keyword arguments of `add` that are `NodeRef`s are inputs, the rest
    are operator parameters."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.specs: list[NodeSpec] = []

    def add(
        self,
        name: str,
        op: str | Operator,
        *,
        after: tuple[NodeRef, ...] | list[NodeRef] = (),
        every: int | None = None,
        **kwargs: Any,
    ) -> NodeRef:
        inputs = {k: v.name for k, v in kwargs.items() if isinstance(v, NodeRef)}
        params = {k: v for k, v in kwargs.items() if not isinstance(v, NodeRef)}
        self.specs.append(NodeSpec(name, op, params, inputs, [a.name for a in after], every))
        return NodeRef(name)

    def build(self) -> PipelineGraph:
        return compile_pipeline(self.name, self.specs)


def compile_pipeline(name: str, specs: list[NodeSpec], where: str = "pipeline") -> PipelineGraph:
    """Check `specs` and build the graph; raise `ConfigError` listing every problem found."""
    problems: list[Problem] = []
    nodes: dict[str, Node] = {}
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        here = f"{where}.nodes[{i}] ({spec.name!r})"
        if spec.name in seen:
            problems.append(Problem(here, f"duplicate node name {spec.name!r}; give every node a unique name"))
            continue
        seen.add(spec.name)
        try:
            op = resolve_operator(spec.op)
        except LookupError as exc:
            problems.append(Problem(f"{here}.op", str(exc)))
            continue
        params, bad = op.check_params(spec.params, here)
        problems += bad
        if spec.every is not None and spec.every < 1:
            problems.append(Problem(f"{here}.every", f"must be >= 1, got {spec.every}"))
        if params is not None:
            nodes[spec.name] = Node(spec.name, op, params, dict(spec.inputs), list(spec.after), spec.every)

    g = nx.DiGraph()
    for n in nodes.values():
        g.add_node(n.name, node=n)
    for i, spec in enumerate(specs):
        node = nodes.get(spec.name)
        if node is None:
            continue
        here = f"{where}.nodes[{i}] ({spec.name!r})"
        op = node.operator
        for port, src in spec.inputs.items():
            if port not in op.inputs:
                known = ", ".join(op.inputs) or "none"
                problems.append(
                    Problem(f"{here}.inputs.{port}", f"operator {op.name!r} has no input {port!r}; its inputs: {known}")
                )
                continue
            if src not in seen:
                problems.append(
                    Problem(
                        f"{here}.inputs.{port}", f"refers to unknown node {src!r}; nodes: {', '.join(sorted(seen))}"
                    )
                )
                continue
            if src not in nodes:
                continue  # the source node has its own problem
            produced, wanted = nodes[src].operator.output, op.inputs[port].type
            if not issubclass(produced, wanted):
                problems.append(
                    Problem(
                        f"{here}.inputs.{port}",
                        f"node {src!r} outputs {produced.__name__} but input {port!r} of operator {op.name!r} expects "
                        f"{wanted.__name__}; connect a node whose operator returns {wanted.__name__}",
                    )
                )
                continue
            if nodes[src].every is not None and node.every != nodes[src].every:
                problems.append(
                    Problem(
                        f"{here}.inputs.{port}",
                        f"node {src!r} runs only every {nodes[src].every} iterations; "
                        "a node that consumes it must use the same `every`",
                    )
                )
            g.add_edge(src, spec.name, port=port)
        for port, p in op.inputs.items():
            if port not in spec.inputs and not p.optional:
                problems.append(
                    Problem(
                        f"{here}.inputs",
                        f"missing input {port!r} ({p.type.__name__}) of operator {op.name!r}; "
                        f"connect it to a node that outputs {p.type.__name__}",
                    )
                )
        for src in spec.after:
            if src not in seen:
                problems.append(Problem(f"{here}.after", f"refers to unknown node {src!r}"))
            elif src in nodes and not g.has_edge(src, spec.name):
                g.add_edge(src, spec.name, port=None)
    if not specs:
        problems.append(Problem(where, "the pipeline has no nodes; add at least one node"))
    try:
        cycle = nx.find_cycle(g)
        path = " -> ".join([str(e[0]) for e in cycle] + [str(cycle[0][0])])
        problems.append(
            Problem(where, f"the pipeline has a cycle: {path}; an iteration must be a DAG, remove one of these edges")
        )
    except nx.NetworkXNoCycle:
        pass
    if problems:
        raise ConfigError(problems, f"pipeline {name!r}")
    return PipelineGraph(name, g)
