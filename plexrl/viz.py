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
    colors = ["#4C78A8" if graph.node(n).placement == "service" else "#F58518" for n in g.nodes]
    labels = {n: f"{n}\n{graph.node(n).operator.name}" for n in g.nodes}
    width = max(6.0, 2.2 * (1 + max(nx.get_node_attributes(g, "layer").values(), default=0)))
    fig, ax = plt.subplots(figsize=(width, 4))
    nx.draw_networkx(
        g,
        pos,
        ax=ax,
        labels=labels,
        node_color=colors,
        node_size=2600,
        font_size=8,
        font_color="white",
        arrowsize=15,
        node_shape="s",
    )
    edge_labels = {(u, v): d["port"] for u, v, d in g.edges(data=True) if d.get("port")}
    nx.draw_networkx_edge_labels(g, pos, edge_labels=edge_labels, font_size=7, ax=ax)
    ax.set_title(f"pipeline {graph.name}  (blue: service, orange: cpu)")
    ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
