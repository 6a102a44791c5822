"""The draft step on the GPU, one card (tp1) vs the NVLink pair (tp2) vs one rank alone (solo), full preset.

One command gives every figure (GPU only; two cards for tp2):

    python bench/draft_step.py --preset full --ckpt /tmp/full --out draft_step.json --md draft_step.md

It synthesizes the checkpoint on the device when `--ckpt` does not hold one, then per mode captures the rank's
CUDA graph set (`graphs.GraphSet`, batch-invariant kernels of `kernels/gemm.py`) and times graph replays: p50 / p99
/ min over `--replays` for every (requests, n_out) of seed 000's tables, each timed with CUDA events around the
input upload and the replay (as the engine runs a step). Every mode runs in processes of its own, each seeing one
card (tp1 and solo: card 0; the pair: one card per rank). The pair's step time of one replay is the smaller of the
two ranks' times: the rank that arrived last never waits for its peer, so its time is the step's critical path
(the other's includes the host skew between the ranks' launches). Also: the context insert (1-6, 20, 128 rows,
taps uploaded from the host), a STEP's whole engine work (insert + draft), per-card memory, distinct experts read per step, the byte bound (bytes one step
reads / 4.2 TB/s), and a profile of the stages at 1 request (kernel time under the drafter's `dspark.*` ranges).
Each timed call also reports the host's share (`host_p50`: staging, launch calls, wait, from the graph set's stamps).
`--repeats N` runs every mode N times in fresh processes, alternating the modes, and the summary takes each mode's
median: the time outside the kernels differs from one process to the next.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
import traceback
from multiprocessing import shared_memory
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from dspark_ray.rank.graphs import step_graphs_enabled      # noqa: E402
from dspark_ray.kernels.fused_ops import pdl_capable  # noqa: E402

SEED000 = ((1, 5), (1, 4), (2, 5), (2, 4), (3, 5), (3, 4), (4, 5), (4, 4))
INSERT_ROWS = (1, 2, 3, 4, 5, 6, 20, 128)
STEP_ROWS = (1, 3, 6)                  # a STEP at 1 request, n_out 5: these rows inserted, then the draft
# The host's share of a timed call, from the graph set's stamps: (name, from, to).
HOST_PIECES = (("enter_us", "start", "run_in"), ("writable_us", "run_in", "writable"),
               ("stage_us", "writable", "first_launch"), ("launch_insert_us", "first_launch", "insert_launched"),
               ("launch_us", "first_launch", "launched"), ("wait_us", "launched", "synced"))
HBM_TBPS = 4.2         # what cuBLAS reached on these shapes on an H200


def log(msg: str) -> None:
    print(f"[draft_step {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stats(ms: list[float]) -> dict:
    return report.percentiles(ms, "ms", digits=4)


def ensure_checkpoint(preset: str, path: str) -> None:
    from dspark_ray.config import preset as make
    from dspark_ray.weights.synth import synthesize
    from dspark_ray.weights.manifest import MANIFEST_NAME
    if (Path(path) / MANIFEST_NAME).is_file():
        return
    t0 = time.time()
    log(f"synthesizing the {preset} preset into {path} on the GPU")
    synthesize(make(preset), path, device="cuda", progress=False)
    log(f"synthesized in {time.time() - t0:.1f} s")


def _slots(gs, cfg, n, rows, start):
    """The first n slots of the graph set, each holding `rows` context rows at [start, start + rows): full
    windows (inserted through the insert graphs)."""
    from dspark_ray.testing import workload
    out = []
    for i in range(n):
        st = gs.slots[i]
        g = torch.Generator().manual_seed(100 + i)
        st.advance(start, rows)                         # (the graph set takes the slot where it stands)
        gs.run([(st, start, workload.make_taps(cfg, rows, g))], [], [], 1, False)
        out.append(st)
    return out


def weight_bytes(weights: dict) -> tuple[int, int, int]:
    """(dense bytes read every step, bytes of one routed expert of one block, resident bytes) of one rank's shard.
    Tables read by row (embeddings) count as nothing, main_proj (read by the context insert only) too; routed
    experts count per (block, expert) read."""
    dense = expert = total = 0
    for name, t in weights.items():
        b = t.nbytes
        total += b
        if name.startswith("mtp.0.ffn.experts.0."):
            expert += b
        elif (".ffn.experts." in name or name.endswith("embed.weight") or "markov_w1" in name
              or "main_proj" in name):
            continue
        else:
            dense += b
    return dense, expert, total


def run_mode(mode: str, args, rank: int = 0, coll=None, barrier=None, share=None) -> dict:
    """Capture and time one mode in this process (pair: one rank; its peer runs the same code)."""
    from dspark_ray.model.collectives import LocalCollectives
    from dspark_ray.comm.solo import SoloCollectives
    from dspark_ray.rank.graphs import GraphSet
    from dspark_ray.kernels.gemm import dense_for, describe, kernels_for
    from dspark_ray.model.drafter import Drafter
    from dspark_ray.model.layout import Layout
    from dspark_ray.rank.modes import read_rank
    from dspark_ray.observe.recorders import StepMarks
    from dspark_ray.observe.stamps import now
    from dspark_ray.weights.loader import Checkpoint
    ck = Checkpoint(args.ckpt)
    cfg = ck.config
    n_req = max([4] + [b for b, _ in args.shapes])     # the widest batch: the deployment's --max-batch
    kernels = kernels_for(args.matmul, dense_for(n_req * cfg.block_size, args.dense))
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    layout = Layout(cfg, 1 if mode == "tp1" else 2)
    weights = read_rank(ck, layout, rank, "cuda")
    coll = coll or (LocalCollectives(1) if mode == "tp1" else SoloCollectives(rank))
    d = Drafter(cfg, [weights], [layout.vocab_range(rank)[0]], coll, kernels=kernels)
    dense, expert_b, resident = weight_bytes(weights)
    markov_w2 = sum(t.numel() * t.element_size() for n, t in weights.items() if "markov_w2" in n)
    del weights             # the drafter holds what it uses (the routed experts stacked, the per-expert tensors freed)
    t_cache = time.time()
    rows = d.cache_markov_for(args.markov_cache)       # the rows serve --markov-cache caches, sized as a rank does
    torch.cuda.synchronize()
    t_cache = time.time() - t_cache
    if rows == cfg.vocab_size:                         # every row cached: markov_w2 is never read
        dense -= markov_w2
    log(f"{mode} rank {rank}: loaded {resident / 2**30:.2f} GiB in {time.time() - t0:.1f} s ({describe(d.kernels)}); "
        f"Markov bias rows cached: {d.markov_cache_bytes / 2**30:.2f} GiB in {t_cache:.2f} s")
    # Slots for the widest shape timed (4 at least: the step and insert rows use them) and one for the inserts.
    marks = StepMarks()                 # the stamps of the call in hand
    if args.graph_set == "minimal":     # A/B of the time outside the kernels against the set's size (docs/engine.md)
        gs = GraphSet(d, n_slots=5, max_requests=1, n_outs=(5,), insert_buckets=(8, 128), observer=marks)
    else:
        gs = GraphSet(d, n_slots=n_req + 1, max_requests=n_req, observer=marks)
    gs.capture(lambda k, n: log(f"{mode} rank {rank}: captured {k}/{n}") if k % 15 == 0 or k == n else None)
    log(f"{mode} rank {rank}: {gs.n_graphs} graphs in {gs.capture_seconds:.2f} s, {gs.graph_bytes / 2**20:.0f} MiB")
    states = _slots(gs, cfg, n_req if args.graph_set == "full" else 4, cfg.sliding_window + 32, args.start)
    res = {"mode": mode, "rank": rank, "matmul": describe(d.kernels), "capture_s": round(gs.capture_seconds, 3),
           "graph_mib": round(gs.graph_bytes / 2**20, 1), "resident_gib": round(resident / 2**30, 3),
           "markov_cache_gib": round(d.markov_cache_bytes / 2**30, 3), "markov_cache_s": round(t_cache, 2),
           "dense_bytes_per_step": dense, "expert_bytes": expert_b, "draft": {}, "insert": {}, "step": {},
           "experts": {}}
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    host: dict[str, list[float]] = {}

    def timed(fn, n) -> list[float]:
        """ms of fn() per call (CUDA events around it, after a barrier with the peer in the pair), warm-up dropped.
        Beside it, in `host`, the host's share of each call from the graph set's stamps: staging before the first
        launch, the launch calls, the wait from the last launch until the sync returned (us)."""
        times = []
        host.clear()
        for i in range(args.warmup + n):
            if barrier:
                barrier()
            marks.row = {}
            ev[0].record()
            t0 = now()
            fn()
            ev[1].record()
            ev[1].synchronize()
            if i >= args.warmup:
                times.append(ev[0].elapsed_time(ev[1]))
                row = {"start": t0, **marks.row}      # an insert alone has no launched / synced
                for k, a, b in HOST_PIECES:
                    if a in row and b in row:
                        host.setdefault(k, []).append((row[b] - row[a]) / 1e3)
        return times

    def host_p50() -> dict:
        return {k: round(statistics.median(v), 1) for k, v in host.items()}

    for _ in range(args.settle):        # the card's clocks settle before the first timed shape (seen: its p99 +25 %)
        gs.run([], states[:1], [17], 5, False)
    for bsz, n_out in args.shapes:
        seeds = [17 + 1000 * r for r in range(bsz)]
        d.draft(states[:bsz], seeds, n_out)                      # eager once: routing of this input
        distinct = sum(int(torch.unique(e).numel()) for e in d.last_experts)
        pairs = sum(int(e.numel()) for e in d.last_experts)
        res["experts"][f"{bsz},{n_out}"] = {"distinct": distinct, "pairs": pairs}
        times = timed(lambda: gs.run([], states[:bsz], seeds, n_out, False), args.replays)
        if share:                       # the pair: per replay, the rank that arrived last saw the critical path
            both = share(times)
            res["draft"][f"{bsz},{n_out}"] = stats([min(a, b) for a, b in zip(*both)]) | {
                "rank0_p50_ms": stats(both[0])["p50_ms"], "rank1_p50_ms": stats(both[1])["p50_ms"]}
        else:
            res["draft"][f"{bsz},{n_out}"] = stats(times)
        res["draft"][f"{bsz},{n_out}"]["host_p50"] = host_p50()
        read = dense + distinct * expert_b
        res["draft"][f"{bsz},{n_out}"]["bytes_read"] = read
        res["draft"][f"{bsz},{n_out}"]["byte_bound_ms"] = round(read / (HBM_TBPS * 1e12) * 1e3, 4)
        log(f"{mode} rank {rank}: {bsz} req n_out {n_out}: p50 {res['draft'][f'{bsz},{n_out}']['p50_ms']:.3f} ms")
    from dspark_ray.testing import workload
    st = gs.slots[len(states)]
    for rows in INSERT_ROWS:             # the taps' upload + the insert replay (rows scattered into the pool)
        taps = workload.make_taps(cfg, rows, torch.Generator().manual_seed(rows))

        def insert():
            st.reset()
            gs.run([(st, 0, taps)], [], [], 1, False)
        res["insert"][str(rows)] = stats(timed(insert, args.replays // 3))
    top = states[0].position
    for rows in STEP_ROWS:               # a STEP's engine work: the step graph (insert beside the draft), or both apart
        taps = workload.make_taps(cfg, rows, torch.Generator().manual_seed(rows))

        def step():                  # the rows before `top` again, the draft at `top` (where the slot stands)
            gs.run([(states[0], top - rows, taps)], states[:1], [17], 5, False)
        res["step"][str(rows)] = stats(timed(step, args.replays)) | {"host_p50": host_p50()}
    res["step_batch"] = {}
    for bsz in sorted({b for b, _ in args.shapes if b > 1}):   # a decode round at bsz requests: 3 rows each
        taps = [workload.make_taps(cfg, 3, torch.Generator().manual_seed(50 + r)) for r in range(bsz)]
        tops, seeds = [s.position for s in states[:bsz]], [17 + 1000 * r for r in range(bsz)]

        def step_batch(bsz=bsz, taps=taps, tops=tops, seeds=seeds):
            gs.run([(s, top - 3, t) for s, top, t in zip(states, tops, taps)], states[:bsz], seeds, 5, False)
        res["step_batch"][f"{bsz},3"] = stats(timed(step_batch, args.replays // 2)) | {"host_p50": host_p50()}
        p50 = res["step_batch"][f"{bsz},3"]["p50_ms"]
        log(f"{mode} rank {rank}: step of {bsz} requests x 3 rows: p50 {p50:.3f} ms")
    res["profile_1req"] = profile(d, states, args, barrier)
    res["graph_kernels_1req"] = graph_kernels(gs, states, barrier)
    free, total = torch.cuda.mem_get_info()
    res["memory"] = {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                     "card_used_gib": round((total - free) / 2**30, 3)}
    return res


def _both_profiling(barrier) -> None:
    """In the pair, meet the peer once both profilers run: starting one (CUPTI) can take seconds, longer on one rank
    than the other, and a rank that went ahead would wait in the push collectives past their peer timeout (seen on
    the H200 pair: 'peer timeout' out of this profile)."""
    torch.cuda.synchronize()
    if barrier:
        barrier()


def profile(d, states, args, barrier=None) -> dict:
    """Kernel time per stage at 1 request, n_out 5 (eager, under torch.profiler; kernels of each `dspark.*` range)."""
    from torch.profiler import ProfilerActivity
    seeds = [17]
    for _ in range(3):
        d.draft(states[:1], seeds, 5)
    torch.cuda.synchronize()
    n = 10
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _both_profiling(barrier)
        for _ in range(n):
            d.draft(states[:1], seeds, 5)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("dspark."):
            dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            out[e.key[len("dspark."):]] = round(dev / n, 1)             # us per step
    return out


def graph_kernels(gs, states, barrier=None, n: int = 10, top: int = 15) -> dict:
    """What one graph replay at 1 request, n_out 5 runs: kernels per step, their summed time, the top kernels."""
    from torch.profiler import ProfilerActivity
    for _ in range(3):
        gs.run([], states[:1], [17], 5, False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        _both_profiling(barrier)
        for _ in range(n):
            gs.run([], states[:1], [17], 5, False)
        torch.cuda.synchronize()
    rows = [(e.key, (getattr(e, "device_time_total", None) or e.cuda_time_total) / n, e.count / n)
            for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows = [r for r in rows if r[1] > 0]
    rows.sort(key=lambda r: -r[1])
    return {"kernels_per_step": round(sum(r[2] for r in rows)), "kernel_us_per_step": round(sum(r[1] for r in rows), 1),
            "top": [{"kernel": k[:90], "us": round(t, 1), "count": round(c, 1)} for k, t, c in rows[:top]]}


# --- fresh processes, one card each, as the service's rank actors run ---------------------------------------------
# Every run starts from a fresh process and allocator, whatever ran before it. The body returns a dict; an exception
# in it comes back with its traceback and is raised here, naming the process. One torch thread per process (two
# processes with all-core OpenMP pools stall each other), each optionally pinned to one vCPU.

def free_port() -> int:
    """A free TCP port on the loopback for the pair's gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(key: str, card: int, cpu: int | None, fn, fn_args: tuple, q) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(card)        # before anything initializes CUDA in this process
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    try:
        q.put((key, fn(*fn_args)))
    except BaseException as e:       # noqa: BLE001 - reported to the parent
        q.put((key, {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-4000:]}))


def _gather(procs: list, q, timeout_s: float) -> dict:
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(60)
    for key, res in got.items():
        if isinstance(res, dict) and "error" in res:
            raise RuntimeError(f"{key}: {res['error']}\n{res['tb']}")
    return got


def run_alone(fn, *fn_args, cpu: int | None = None, timeout_s: float = 600) -> dict:
    """fn(*fn_args) in a process of its own that sees card 0 alone."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    return _gather([ctx.Process(target=_child, args=("one card", 0, cpu, fn, fn_args, q))], q, timeout_s)["one card"]


def run_ranks(fn, *fn_args, cpus=(None, None), timeout_s: float = 600) -> tuple[dict, dict]:
    """fn(rank, port, barrier_name, *fn_args) for rank 0 on card 0 and rank 1 on card 1, at once; their results.
    The ranks get a free loopback port for their gloo rendezvous and a zeroed 16-byte shared-memory block for
    `SpinBarrier`."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    # Named with this process's pid, as a ring is: the test suite's leftover check tells its names from others' by it.
    shm = shared_memory.SharedMemory(name=f"dsr-barrier-{os.getpid()}-{secrets.token_hex(4)}", create=True, size=16)
    shm.buf[:16] = bytes(16)
    try:
        procs = [ctx.Process(target=_child, args=(f"pair rank {r}", r, cpus[r], fn, (r, port, shm.name, *fn_args), q))
                 for r in (0, 1)]
        got = _gather(procs, q, timeout_s)
    finally:
        shm.close()
        shm.unlink()
    return got["pair rank 0"], got["pair rank 1"]


def pinned(cpus: str, index: int) -> int | None:
    """Entry `index` of a "--pin-cpus 2,3" list, or None when the list is empty."""
    from dspark_ray.cli import cpu_list
    return cpu_list(cpus)[index] if cpus else None


# --- the pair: two processes, one card each ---------------------------------------------------------------------

class SpinBarrier:
    """The pair's barrier before each timed call: both ranks spin on two counters in shared memory, as the
    service's rank loop spins. Ranks woken from a blocking barrier (gloo) stage and launch their step slower."""

    def __init__(self, name: str, rank: int):
        from multiprocessing import shared_memory
        import numpy as np
        self.shm = shared_memory.SharedMemory(name=name)
        self.counts = np.ndarray((2,), dtype=np.int64, buffer=self.shm.buf)
        self.rank, self.n = rank, 0

    def __call__(self) -> None:
        self.n += 1
        self.counts[self.rank] = self.n
        other = self.counts[1 - self.rank:2 - self.rank]
        deadline = time.monotonic() + 60
        while other[0] < self.n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"pair rank {self.rank}: the peer did not reach barrier {self.n} in 60 s")


def connect_pair_rank(rank: int, port: int, ckpt: str, push: bool = True):
    """In a pair rank's process (CUDA_VISIBLE_DEVICES names its card alone): gloo over `port`, then the push
    collectives with the peer over it. Returns (gloo, push collectives), or (gloo, None) without `push` (the
    processes then never map each other's memory)."""
    from dspark_ray.comm.gloo import GlooCollectives
    from dspark_ray.comm.push import connect_over
    from dspark_ray.model.layout import Layout
    from dspark_ray.weights.loader import Checkpoint
    torch.cuda.set_device(0)
    gloo = GlooCollectives(rank, 2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=600)
    if not push:
        return gloo, None
    cfg = Checkpoint(ckpt).config
    # The peer timeout is the service's default (10 s), not a tight one: an eager step's first pass may compile a
    # kernel on one rank while the other waits in a collective.
    return gloo, connect_over(gloo.group, rank, Layout(cfg, 2).vocab_range(1 - rank), 10.0)


def _pair_rank(rank: int, port: int, shm_name: str, args) -> dict:
    """One rank of the pair, in its own process (`run_ranks`)."""
    import torch.distributed as dist
    gloo, pc = connect_pair_rank(rank, port, args.ckpt)

    def share(obj):
        out = [None, None]
        dist.all_gather_object(out, obj, group=gloo.group)
        return out
    barrier = SpinBarrier(shm_name, rank) if args.barrier == "spin" else (lambda: dist.barrier(group=gloo.group))
    dist.barrier(group=gloo.group)          # both attached to the shared counters
    res = run_mode("pair", args, rank, pc, barrier=barrier, share=share)
    pc.check_error()
    res["collectives"] = pc.describe()
    return res


def run_one_card(mode: str, args) -> dict:
    """tp1 / solo in a process of its own that sees card 0 alone, as each pair rank sees its card."""
    return run_alone(run_mode, mode, args, cpu=pinned(args.pin_cpus, 0), timeout_s=args.pair_timeout)


def run_pair(args) -> dict:
    r0, r1 = run_ranks(_pair_rank, args, cpus=(pinned(args.pin_cpus, 0), pinned(args.pin_cpus, 1)),
                       timeout_s=args.pair_timeout)
    return {"rank0": r0, "rank1": r1}


def summary(out: dict) -> dict:
    """Ratios at each (requests, n_out): pair / one card, collectives share = (pair - solo) / pair, pair / bytes."""
    rows = {}
    timed = out.get("tp1") or out.get("solo") or out["pair"]["rank0"]

    def p50(m: str, k: str) -> float | None:       # the median over the mode's runs (one run: its p50)
        if m not in out:
            return None
        runs = out[m].get("repeat_p50_ms", {}).get(k)
        return round(statistics.median(runs), 4) if runs else (out[m]["rank0"] if m == "pair" else out[m])[
            "draft"][k]["p50_ms"]

    for k in timed["draft"]:                       # the shapes this run timed
        tp1, solo, pair = p50("tp1", k), p50("solo", k), p50("pair", k)
        row = {"tp1_ms": tp1, "solo_ms": solo, "pair_ms": pair}
        if pair and tp1:
            row["pair_over_tp1"] = round(pair / tp1, 3)
        if pair and solo:
            row["collectives_share"] = round((pair - solo) / pair, 3)
        if pair:
            row["pair_over_byte_bound"] = round(pair / out["pair"]["rank0"]["draft"][k]["byte_bound_ms"], 2)
        if "tp1" in out:
            row["tp1_byte_bound_ms"] = out["tp1"]["draft"][k]["byte_bound_ms"]
        # The GPU's part alone (the wait after the last launch, the first run of each mode): steadier than the
        # step, whose host share moves by tens of us from one process to the next.
        tp1_w, solo_w, pair_w = gpu_wait_us(out, "tp1", k), gpu_wait_us(out, "solo", k), gpu_wait_us(out, "pair", k)
        row |= {"tp1_gpu_us": tp1_w, "solo_gpu_us": solo_w, "pair_gpu_us": pair_w}
        if pair_w and tp1_w:
            row["pair_over_tp1_gpu"] = round(pair_w / tp1_w, 3)
        if pair_w and solo_w:
            row["collectives_share_gpu"] = round((pair_w - solo_w) / pair_w, 3)
        rows[k] = row
    return rows


def gpu_wait_us(out: dict, mode: str, k: str) -> float | None:
    """The mode's p50 wait after its last launch at shape k (the pair: the smaller of its two ranks', as the pair's
    step is the smaller of theirs); None when not measured."""
    if mode not in out:
        return None
    runs = [out[mode]["rank0"], out[mode]["rank1"]] if mode == "pair" else [out[mode]]
    waits = [r["draft"][k].get("host_p50", {}).get("wait_us") for r in runs]
    return min(waits) if all(w is not None for w in waits) else None


def _cache_note(res: dict) -> str:
    """The cached Markov bias rows of a mode's result (results from before the cache have none to report)."""
    return f", cached Markov bias rows {res['markov_cache_gib']} GiB" if "markov_cache_gib" in res else ""


def markdown(out: dict) -> str:
    lines = [f"# Draft step, {out['preset']} preset, {out['device']} (commit {out['commit']})", "",
             f"Command: `{out['command']}`", "",
             "Graph replay incl. the input upload, p50 over "
             f"{out['replays']} replays (ms). Pair = per replay the smaller of the two ranks' times.", "",
             "| requests, n_out | one card (tp1) | pair (tp2) | pair / one card | solo rank | collectives share "
             "| pair / byte bound | distinct experts (pair rank 0) |", "|---|---|---|---|---|---|---|---|"]
    for k, r in out["summary"].items():
        ex = out.get("pair", {}).get("rank0", {}).get("experts", {}).get(k, {}).get("distinct", "")
        lines.append(f"| {k} | {r.get('tp1_ms')} | {r.get('pair_ms')} | {r.get('pair_over_tp1', '')} | "
                     f"{r.get('solo_ms')} | {r.get('collectives_share', '')} | {r.get('pair_over_byte_bound', '')} "
                     f"| {ex} |")
    lines += ["", "The GPU's part: the wait after the last launch, p50 us (the pair: the smaller of its ranks'; the "
                  "first run of each mode), and the same ratios on it:", "",
              "| requests, n_out | one card (tp1) | pair (tp2) | pair / one card | solo rank | collectives share |",
              "|---|---|---|---|---|---|"]
    for k, r in out["summary"].items():
        lines.append(f"| {k} | {r.get('tp1_gpu_us')} | {r.get('pair_gpu_us')} | {r.get('pair_over_tp1_gpu', '')} | "
                     f"{r.get('solo_gpu_us')} | {r.get('collectives_share_gpu', '')} |")
    modes = [m for m in ("tp1", "solo", "pair") if m in out]
    for title, key, row_counts in (
            ("Context insert alone (the taps' upload + the insert replay, rows scattered into the slot pool), p50 ms:",
             "insert", INSERT_ROWS),
            ("A STEP's engine work at 1 request, n_out 5 (`GraphSet.run`: " + (
                "the rows inserted beside the draft in one step graph replay, its upload and download" if
                out.get("step_graphs") else "one upload, the insert replay, the draft replay, one download") +
             "), p50 ms:", "step", STEP_ROWS)):
        lines += ["", title, "", "| rows | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for rows in row_counts:
            vals = [str((out[m]["rank0"] if m == "pair" else out[m])[key][str(rows)]["p50_ms"]) for m in modes]
            lines.append(f"| {rows} | " + " | ".join(vals) + " |")
    if "rope" in out:
        r = out["rope"]
        lines += ["", f"RoPE: no table (angles computed per position, exact below 2^24); positions up to max_model_len "
                      f"{r['max_model_len']} are served; a cos / sin table of that size would take "
                      f"{r['table_at_max_model_len_bytes'] / 2**20:.0f} MiB per card. Slots start at position "
                      f"{out.get('start', '?')}."]
    lines += ["", "Kernel time per stage at 1 request, n_out 5 (us, eager under the profiler):", ""]
    for m in ("tp1", "solo", "pair"):
        if m in out:
            src = out[m]["rank0"] if m == "pair" else out[m]
            lines.append(f"- {m}: " + ", ".join(f"{k} {v}" for k, v in sorted(src["profile_1req"].items(),
                                                                               key=lambda kv: -kv[1])))
    lines += ["", "One graph replay at 1 request, n_out 5 (under the profiler): kernels, summed kernel time, top kernels:",
              ""]
    for m in ("tp1", "solo", "pair"):
        if m in out:
            g = (out[m]["rank0"] if m == "pair" else out[m]).get("graph_kernels_1req")
            if g:
                lines.append(f"- {m}: {g['kernels_per_step']} kernels, {g['kernel_us_per_step']} us; "
                             + ", ".join(f"{t['kernel'][:40]} {t['us']} us x{t['count']}" for t in g["top"][:8]))
    lines += ["", "Memory per card: " + "; ".join(
        f"{m} {(out[m]['rank0'] if m == 'pair' else out[m])['memory']['card_used_gib']} GiB used, graphs "
        f"{(out[m]['rank0'] if m == 'pair' else out[m])['graph_mib']} MiB" + _cache_note(out[m]['rank0'] if m == 'pair'
                                                                                  else out[m])
        for m in ("tp1", "solo", "pair") if m in out)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="full")
    ap.add_argument("--ckpt", default="/tmp/dspark_full")
    ap.add_argument("--modes", default="tp1,solo,pair", help="comma list of tp1, solo, pair")
    ap.add_argument("--shapes", default=" ".join(f"{b},{n}" for b, n in SEED000),
                    help="(requests, n_out) pairs to time, e.g. '1,5 4,4' for a quick A/B, '8,5 16,5' for the wide "
                         "buckets (default: seed 000's)")
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20, help="untimed replays before each timed shape")
    ap.add_argument("--settle", type=int, default=300, help="untimed replays before the first shape")
    ap.add_argument("--start", type=int, default=5000, help="position of the slots' context rows")
    ap.add_argument("--matmul", default="fast", help="fast (batch-invariant GPU kernels) or exact")
    ap.add_argument("--dense", default="auto", choices=["auto", "triton", "cublas"],
                    help="the dense linears' kernel (gemm.dense_for; auto: as serve --dense auto with --max-batch the "
                         "widest shape timed)")
    ap.add_argument("--markov-cache", default="auto",
                    help="cached Markov bias rows, as serve --markov-cache: auto (serve's default: every token's row "
                         "when they fit in half the memory the weights leave), all, off or a row count")
    ap.add_argument("--graph-set", choices=["full", "minimal"], default="full",
                    help="minimal: only the 1-request n_out-5 draft graph and the 8 / 128-row inserts (shape 1,5)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each mode (fresh processes, alternating modes); the summary takes the median")
    ap.add_argument("--pair-timeout", type=float, default=540)
    ap.add_argument("--pin-cpus", default="", help="comma list of vCPUs: rank r's process (tp1 / solo: the "
                    "first) runs on entry r alone (unpinned, one pair rank's host share was seen at twice the other's)")
    ap.add_argument("--barrier", choices=["spin", "gloo"], default="spin",
                    help="the pair's barrier before each timed call (see SpinBarrier)")
    ap.add_argument("--out")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    args.shapes = [tuple(int(v) for v in p.split(",")) for p in args.shapes.split()]
    if args.graph_set == "minimal":
        args.shapes = [(1, 5)]
    if not torch.cuda.is_available():
        print("bench/draft_step.py needs CUDA", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    ensure_checkpoint(args.preset, args.ckpt)
    out = {**report.header(__file__, argv, gpu=True), "preset": args.preset,
           "cards": torch.cuda.device_count(), "replays": args.replays,
           "torch": torch.__version__, "start": args.start, "pdl": pdl_capable(),
           "step_graphs": step_graphs_enabled()}
    from dspark_ray.weights.loader import Checkpoint
    cfg = Checkpoint(args.ckpt).config
    half = cfg.qk_rope_head_dim // 2
    # RoPE: the angles f32(w_i * p) are computed per position in the kernels (p is exact in fp32 below 2^24), so no
    # table is held; what one sized to max_model_len would take (cos and sin, fp32) is reported beside it.
    out["rope"] = {"table_bytes": 0, "max_model_len": cfg.max_model_len, "positions_exact_below": 1 << 24,
                   "table_at_max_model_len_bytes": cfg.max_model_len * half * 2 * 4}
    modes = args.modes.split(",")
    if "pair" in modes and torch.cuda.device_count() < 2:
        log("pair skipped: needs two cards")
        modes.remove("pair")
    # Each run is a fresh process; the time outside the kernels differs from one process to the next by up to
    # ~0.15 ms (bench/results/gpu/graph_set_ab_h200x2.txt), so with --repeats the modes alternate and the summary
    # takes each mode's median over its runs (the first run keeps every other figure).
    for rep in range(args.repeats):
        for m in modes:
            res = run_pair(args) if m == "pair" else run_one_card(m, args)
            draft = (res["rank0"] if m == "pair" else res)["draft"]
            first = out.setdefault(m, res)
            for k, v in draft.items():
                first.setdefault("repeat_p50_ms", {}).setdefault(k, []).append(v["p50_ms"])
            out["summary"] = summary(out)
            report.save(out, args.out)      # after every run: a run cut short still leaves what it measured
            if args.md:
                Path(args.md).write_text(markdown(out))
    report.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
