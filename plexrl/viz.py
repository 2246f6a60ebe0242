"""Pictures: the pipeline DAG as a PNG (matplotlib + networkx; no graphviz needed)."""

from __future__ import annotations

from pathlib import Path

import networkx as nx

from plexrl.graph import PipelineGraph


def draw_pipeline(graph: PipelineGraph, path: Path) -> Path:
    """Draw `graph` left to right by topological layer; service nodes blue, cpu nodes orange."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = graph.graph.copy()
    for layer, names in enumerate(nx.topological_generations(g)):
        for name in names:
            g.nodes[name]["layer"] = layer
    pos = nx.multipartite_layout(g, subset_key="layer")
    colors = ["#4C78A8" if graph.node(n).runs_on == "service" else "#F58518" for n in g.nodes]
    labels = {n: n if graph.node(n).operator.name == n else f"{n}\n({graph.node(n).operator.name})" for n in g.nodes}
    layers = nx.get_node_attributes(g, "layer")
    width = max(6.0, 2.4 * (1 + max(layers.values(), default=0)))
    fig, ax = plt.subplots(figsize=(width, 4))
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=colors, node_size=4200, node_shape="s")
    nx.draw_networkx_labels(g, pos, labels=labels, ax=ax, font_size=6.5, font_color="white")
    for u, v, port in g.edges(data="port"):
        skip = abs(layers[v] - layers[u]) > 1  # bend edges that jump a layer so they do not hide behind others
        nx.draw_networkx_edges(
            g,
            pos,
            edgelist=[(u, v)],
            ax=ax,
            node_size=4200,
            node_shape="s",
            arrowsize=14,
            style="solid" if port else "dashed",
            connectionstyle=f"arc3,rad={0.35 if skip else 0.0}",
        )
    ax.set_title(f"pipeline {graph.name}  (blue: service, orange: cpu)")
    ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
