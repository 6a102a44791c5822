"""Why does a pair rank stage and launch its draft graph slower than one card does? (GPU only; two cards.)

`draft_step` saw a pair rank's launch call take 24-54 us of host time against 11-20 us for one card and a solo rank,
whose graph holds the same kernels with local stand-ins for the collectives. Here each pair rank's process captures
its shard twice, once with the push collectives and once with the solo stand-ins (a minimal graph set each: 1
request, n_out 5), and times per replay the staging, the launch call alone (`CUDAGraph.replay`) and the wait,
alternating the two graphs, both ranks at once behind a spinning barrier. Then one process alone on card 0 does the
same with a solo and a one-card (tp1) graph. Same process, same core, same seconds: the push kernel nodes' own
launch cost is the difference between the two graphs of one rank. Each pair rank then times its solo graph once more
while its peer sleeps ("solo, peer idle"), and `--stagger-us` adds runs where rank 1 starts after rank 0 has
launched: whether the two ranks' hosts slow each other, or a pair rank's process is slow by itself. `--no-push`
builds the pair without the push collectives (gloo only, no CUDA IPC mappings in either process).

    python bench/graph_launch.py --ckpt /tmp/full [--replays 400] [--pin-cpus 2,4] [--out FILE]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.card_procs import pinned, run_alone, run_pair  # noqa: E402
from bench.draft_step import SpinBarrier, _slots, connect_pair_rank, log  # noqa: E402
from bench.tcp_roundtrip import _commit, _device, emit  # noqa: E402

PIECES = ("stage", "launch_call", "wait")


def us_stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"p50_us": round(s[len(s) // 2], 1), "p99_us": round(s[min(len(s) - 1, int(0.99 * len(s)))], 1),
            "min_us": round(s[0], 1), "n": len(s)}


def graph_set(coll, rank: int, tp: int, ckpt: str):
    """One shard's drafter on `coll`, its minimal graph set captured, one slot filled from position 900,000."""
    from dspark_ray.graphs import GraphSet
    from dspark_ray.kernels.gemm import kernels_for
    from dspark_ray.model.drafter import Drafter
    from dspark_ray.model.layout import Layout
    from dspark_ray.modes import read_rank
    from dspark_ray.weights.loader import Checkpoint
    kernels = kernels_for("fast")
    ck = Checkpoint(ckpt)
    layout = Layout(ck.config, tp)
    d = Drafter(ck.config, [read_rank(ck, layout, rank, "cuda")], [layout.vocab_range(rank)[0]], coll,
                kernels=kernels)
    gs = GraphSet(d, n_slots=2, max_requests=1, n_outs=(5,), insert_buckets=(8,))
    gs.capture()
    return gs, _slots(gs, ck.config, 1, ck.config.sliding_window + 32, 900000)


def time_launches(sets: dict, colls: dict, replays: int, barrier=None, stagger_us: float = 0.0,
                  waits: bool = False) -> dict:
    """Per graph: the staging, the launch call alone and the wait until the download is on the host (us).

    With `stagger_us`, each graph is also timed staggered (key "<graph> staggered", alternating with the plain runs):
    the process that `waits` (the pair's rank 1) spins that long after the barrier, so its peer has staged and
    launched before it starts: neither stages or launches while the other does (rank 0 is then in its wait). Both
    ranks run the same loop (the barrier counts must match); only the waiting one delays."""
    from dspark_ray.stamps import now
    variants = [(k, k, 0.0) for k in sets]
    if stagger_us:
        variants += [(f"{k} staggered", k, stagger_us if waits else 0.0) for k in sets]
    got = {name: {p: [] for p in PIECES} for name, _, _ in variants}
    for i in range(replays + 50):
        for name, k, delay in variants:
            gs, states = sets[k]
            if barrier:
                barrier()
            if delay:
                until = now() + delay * 1e3
                while now() < until:
                    pass
            g = gs.draft_graphs[(1, 5, False)]
            t0 = now()
            gs._stage_draft(states, [17])
            t1 = now()
            guard = getattr(colls[k], "guard", None)
            if guard is not None:          # the push backend's epoch book, as its replay() keeps it
                guard.before_replay(g.n_collectives)
            t2 = now()
            g.graph.replay()
            t3 = now()
            gs.inp.mark()
            gs.inp.synchronize()
            t4 = now()
            if i >= 50:
                for p, a, b in zip(PIECES, (t0, t2, t3), (t1, t3, t4)):
                    got[name][p].append((b - a) / 1e3)
    return {k: {p: us_stats(v) for p, v in r.items()} for k, r in got.items()}


def _pair_rank(rank: int, port: int, shm_name: str, args) -> dict:
    import torch.distributed as dist
    from dspark_ray.comm.solo import SoloCollectives
    # --no-push: the pair's processes without the peer's memory mapped (gloo only), solo graphs alone
    gloo, push = connect_pair_rank(rank, port, args.ckpt, push=not args.no_push)
    colls = {"solo": SoloCollectives(rank)} if push is None else {"push": push, "solo": SoloCollectives(rank)}
    dist.barrier(group=gloo.group)
    sets = {k: graph_set(c, rank, 2, args.ckpt) for k, c in colls.items()}
    log(f"pair rank {rank}: graph sets {', '.join(sets)} captured")
    dist.barrier(group=gloo.group)
    res = time_launches(sets, colls, args.replays, SpinBarrier(shm_name, rank), stagger_us=args.stagger_us,
                        waits=rank == 1)
    if "push" in colls:
        colls["push"].check_error()
    # The solo graph again, each rank in turn while its peer sleeps in a blocking barrier: the same process (its
    # peer's memory still mapped), no host and no GPU of the peer working. Fast here and slow above: the two
    # ranks slow each other; slow in both: this process is slow by itself.
    for turn in (0, 1):
        dist.barrier(group=gloo.group)
        if rank == turn:
            res["solo, peer idle"] = time_launches({"solo": sets["solo"]}, colls, args.replays)["solo"]
    dist.barrier(group=gloo.group)
    return res


def _alone(args) -> dict:
    from dspark_ray.comm.local import LocalCollectives
    from dspark_ray.comm.solo import SoloCollectives
    solo, tp1 = SoloCollectives(0), LocalCollectives(1)
    sets = {"solo": graph_set(solo, 0, 2, args.ckpt), "tp1": graph_set(tp1, 0, 1, args.ckpt)}
    log("alone: both graph sets captured")
    return time_launches(sets, {"solo": solo, "tp1": tp1}, args.replays)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", required=True, help="a full-preset checkpoint (bench/draft_step.py synthesizes one)")
    ap.add_argument("--replays", type=int, default=400)
    ap.add_argument("--pin-cpus", default="2,4", help="vCPU of rank 0, rank 1 (the process alone takes rank 0's)")
    ap.add_argument("--stagger-us", type=float, default=0.0,
                    help="also time each graph with rank 1 starting this long after rank 0 (e.g. 150): are the two "
                         "hosts slower when they stage and launch at the same time?")
    ap.add_argument("--no-push", action="store_true",
                    help="the pair's processes meet over gloo only (no CUDA IPC mappings) and time solo graphs")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("graph_launch: needs two CUDA devices", file=sys.stderr)
        return 2
    out = {"bench": "graph_launch", "command": "python bench/graph_launch.py " + " ".join(sys.argv[1:]),
           "config": {"preset": "full", "requests": 1, "n_out": 5, "replays": args.replays,
                      "pin_cpus": args.pin_cpus, "stagger_us": args.stagger_us, "no_push": args.no_push},
           "device": f"{torch.cuda.get_device_name(0)}; host {_device()}", "cards": torch.cuda.device_count(),
           "commit": _commit()}
    cpus = (pinned(args.pin_cpus, 0), pinned(args.pin_cpus, 1))
    out["pair_rank0"], out["pair_rank1"] = run_pair(_pair_rank, args, cpus=cpus)
    out["alone"] = run_alone(_alone, args, cpu=cpus[0])
    out["launch_call_p50_us"] = {f"{k} {g}": out[k][g]["launch_call"]["p50_us"]
                                 for k in ("pair_rank0", "pair_rank1", "alone") for g in out[k]}
    emit(out, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
