"""What a draft graph holds before its first model kernel: the graph's nodes as CUDA prints them, and the kernel
timeline of a replay, for one card (tp1). GPU only.

The kernel timeline of every draft graph showed ~8.6 us between the upload copy kernel and the first model kernel
(`bench/kernel_timeline.py`), where small graphs of the same first kernels show none (`bench/graph_start_gap.py`);
the graph set's fence after the upload removes it (`bench/results/gpu/upload_fence_ab_h200.json`: the A/B).
This dumps the (1 request, n_out 5) draft graph with `cudaGraphDebugDotPrint` (every node: kernels, memsets,
memcpys, event and empty nodes, and their edges) and sums it up: the node kinds, the roots, the first nodes.

    python bench/graph_nodes.py --preset tiny --out-dir bench/results/gpu/graph_nodes
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _DebugGraph(torch.cuda.CUDAGraph):
    """A CUDAGraph that keeps its graph after instantiation, so it can be printed."""

    def __init__(self, *a, **k):
        try:
            super().__init__(keep_graph=True)
        except TypeError:                         # an older torch: no keep_graph
            super().__init__()
        self.enable_debug_mode()


def dot_summary(dot: str) -> dict:
    """Node kinds, the roots, and the first nodes in the order CUDA prints them (each as its kind and, for a
    kernel, its function name). A node's line is `"graph_G_node_N"[... label="{KIND | {ID | n (topoId: t) | name
    ...}"]`; an edge's is `"graph_G_node_A" -> "graph_G_node_B" [...]`."""
    nodes = {}
    for m in re.finditer(r'^"(graph_\d+_node_\d+)"\[.*?label="\{(\w+)(.*?)"\];', dot, re.S | re.M):
        name = re.search(r"\(topoId: \d+\) \| ([^\\|}]+)", m.group(3))
        nodes[m.group(1)] = m.group(2) + (f" {name.group(1).strip()}" if name else "")
    edges = re.findall(r'^"(graph_\d+_node_\d+)" -> "(graph_\d+_node_\d+)"', dot, re.M)
    has_pred = {b for _, b in edges}
    kinds: dict[str, int] = {}
    for text in nodes.values():
        kinds[text.split(" ")[0]] = kinds.get(text.split(" ")[0], 0) + 1
    return {"nodes": len(nodes), "edges": len(edges), "kinds": kinds,
            "roots": [t for n, t in nodes.items() if n not in has_pred],
            "first_nodes": list(nodes.values())[:12]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ckpt", help="an existing checkpoint (else the preset, synthesized into /tmp/<preset>)")
    ap.add_argument("--out-dir", default="graph_nodes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "graph_nodes", "skipped": "no CUDA"}))
        return 0
    from bench.kernel_timeline import timeline
    from dspark_ray import config
    from dspark_ray.weights.synth import synthesize
    ckpt = args.ckpt or f"/tmp/{args.preset}"
    if not Path(ckpt, "dspark-manifest.json").exists() and not args.ckpt:
        synthesize(getattr(config, args.preset)(), ckpt, device="cuda", progress=False)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.cuda.CUDAGraph = _DebugGraph            # graphs.py builds its graphs through this name
    import dspark_ray.graphs as graphs
    captured = {}
    orig = graphs.GraphSet.capture

    def capture(self, *a, **k):
        orig(self, *a, **k)
        captured["set"] = self
    graphs.GraphSet.capture = capture
    from dspark_ray.settings import current
    res = {"bench": "graph_nodes", "device": torch.cuda.get_device_name(), "ckpt": ckpt,
           "settings": current().to_dict(),
           "timeline": timeline("tp1", 0, ckpt, 1000)}
    gs = captured["set"]
    for name, g in (("draft_1x5", gs.draft_graphs[(1, 5, False)]),):
        path = out_dir / f"{name}.dot"
        g.graph.debug_dump(str(path))
        res[name] = dot_summary(path.read_text())
    ks = res["timeline"]["kernels"]
    res["timeline"] = {"gpu_span_us": res["timeline"]["gpu_span_us"], "first_kernels": ks[:6]}
    print(json.dumps(res, indent=1))
    (out_dir / "summary.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
