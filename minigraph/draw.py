"""Draw a graph as DOT (always) and PNG (with Graphviz's dot, else matplotlib), nodes coloured
by device after scheduling, cross-device copies as dashed red edges."""
from __future__ import annotations

import shutil
import subprocess

PALETTE = ["#8ecae6", "#ffb703", "#90be6d", "#f28482", "#cdb4db", "#f4a261", "#adb5bd"]


def _colour(device, devices):
    if device is None:
        return "#ffffff"
    return PALETTE[devices.index(device) % len(PALETTE)]


MIN_FONT_PT = 9       # matplotlib labels smaller than this cannot be read on a printed page


def focused(g, only):
    """The part of g to draw: every vertex when ``only`` is None, else the tensor ids in ``only``
    and their direct sources and consumers (so each kept node shows what it reads and feeds)."""
    if only is None:
        return g
    keep = set(i for i in only if i in g)
    for i in list(keep):
        keep.update(g.predecessors(i))
        keep.update(g.successors(i))
    return g.subgraph(keep)


def to_dot(gf, sched=None, only=None) -> str:
    """DOT text of gf; ``sched`` as in Graph.to_networkx (default: gf's newest live schedule);
    ``only``: tensor ids to draw (with their neighbours), None for all."""
    g = focused(gf.to_networkx(sched), only)
    devices = sorted({d.get("device") for _, d in g.nodes(data=True) if d.get("device")})
    lines = ["digraph minigraph {", "  rankdir=TB; node [shape=box, style=filled, fontname=monospace];"]
    for nid, d in g.nodes(data=True):
        label = f"{d['name'] or d['op'].lower()}\\n{d['op']} {d['type']} {d['ne']}"
        if d.get("device"):
            label += f"\\n{d['device']} ({d['cause']})"
        shape = "ellipse" if d["op"] == "NONE" else ("note" if d["is_view"] else "box")
        lines.append(f'  n{nid} [label="{label}", shape={shape}, fillcolor="{_colour(d.get("device"), devices)}"];')
    for u, v, d in g.edges(data=True):
        if d.get("copy"):
            lines.append(f'  n{u} -> n{v} [color=red, style=dashed, label="copy {d["src_device"]}->{d["dst_device"]} {d["nbytes"]}B"];')
        else:
            lines.append(f'  n{u} -> n{v} [label="{d.get("role", "")}"];')
    if devices:
        lines.append('  subgraph cluster_legend { label="devices"; ' + " ".join(
            f'"{dv}" [fillcolor="{_colour(dv, devices)}"];' for dv in devices) + " }")
    lines.append("}")
    return "\n".join(lines)


def png_tool() -> str | None:
    """What draws a PNG here: "graphviz" (its dot program), "matplotlib", or None."""
    if shutil.which("dot"):
        return "graphviz"
    try:
        import matplotlib  # noqa: F401
        return "matplotlib"
    except ImportError:
        return None


def draw(gf, path: str, sched=None, only=None) -> list[str]:
    """Write ``path`` as DOT (``.dot``) or PNG (``.png``; its DOT source is written beside it,
    with the same name ending in ``.dot``). ``sched`` (a Scheduler or ScheduledGraph) colours
    nodes by device; by default gf's newest live schedule does. ``only``: tensor ids to draw
    (with their neighbours). Returns the files written, the DOT first."""
    dot = to_dot(gf, sched, only)
    if not path.endswith(".png"):
        with open(path, "w") as f:
            f.write(dot)
        return [path]
    dot_path = path[:-4] + ".dot"
    with open(dot_path, "w") as f:
        f.write(dot)
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tpng", dot_path, "-o", path], check=True)
        return [dot_path, path]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import networkx as nx
    except ImportError:
        raise RuntimeError("PNG needs Graphviz's dot program (apt-get install graphviz) or matplotlib "
                           f"(pip install 'minigraph[viz]'); the DOT file was written to {dot_path}") from None
    g = focused(gf.to_networkx(sched), only)
    devices = sorted({d.get("device") for _, d in g.nodes(data=True) if d.get("device")})
    layers = _layers(g)
    by_layer: dict = {}
    for n, l in layers.items():
        by_layer.setdefault(l, []).append(n)
    width = max(len(v) for v in by_layer.values())
    pos = {n: (j - (len(v) - 1) / 2, -l) for l, v in by_layer.items() for j, n in enumerate(v)}
    # room for MIN_FONT_PT labels: about 1.8 inch per node across, 0.5 inch per layer down
    fig, ax = plt.subplots(figsize=(min(60, max(8, width * 1.8)), min(160, max(6, len(by_layer) * 0.5))))
    nx.draw_networkx_nodes(g, pos, ax=ax, node_color=[_colour(d.get("device"), devices) for _, d in g.nodes(data=True)])
    nx.draw_networkx_labels(g, pos, ax=ax, font_size=MIN_FONT_PT,
                            labels={n: (d["name"] or d["op"].lower()) for n, d in g.nodes(data=True)})
    normal = [(u, v) for u, v, d in g.edges(data=True) if not d.get("copy")]
    copies = [(u, v) for u, v, d in g.edges(data=True) if d.get("copy")]
    nx.draw_networkx_edges(g, pos, edgelist=normal, ax=ax, arrows=True)
    nx.draw_networkx_edges(g, pos, edgelist=copies, ax=ax, arrows=True, edge_color="red", style="dashed")
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color=_colour(d, devices), label=d) for d in devices] +
              [Patch(color="red", label="cross-device copy")], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=MIN_FONT_PT)   # beside the graph, never over a node
    ax.set_title("nodes coloured by device" if devices else "unscheduled", fontsize=MIN_FONT_PT + 2)
    ax.axis("off")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [dot_path, path]


def _layers(g):
    import networkx as nx
    layer = {}
    for n in nx.topological_sort(g):
        preds = list(g.predecessors(n))
        layer[n] = 1 + max((layer[p] for p in preds), default=-1)
    return layer
