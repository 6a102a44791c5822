"""Collectives on the NVLink pair, all inside CUDA graphs: push (the whole safety protocol on) vs NCCL
(torch.distributed) vs torch symmetric-memory one-shot vs a no-safety probe kernel (`PROBE_SRC`: the floor of a flag
protocol), plus the (max, index) and top-2 exchanges.

Method: each op captured 20 times back to back in one graph; a replay is
timed with CUDA events around g.replay(); per-op time = replay time / 20; p50 / p99 / min over --replays replays,
after 5 warm-up replays. Two processes, one card each (CUDA_VISIBLE_DEVICES isolation, as the service's rank actors
run). Every push result is checked bit for bit against P0 + P1 computed locally (both ranks know both seeds).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python bench/collectives.py --out bench/results/collectives_h200x2.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import report  # noqa: E402

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)      # NVLink multicast stays off (it can take the host's GPUs down)

H = 5120
SIZES = [(1, 2), (5, H), (10, H), (15, H), (20, H), (64, H)]

# The no-safety floor, the design's first probe kernel (push_ar4): float4 push, per-block flags, device-side epoch;
# no timeouts, no error word, no acks, no parity check of the shape.
PROBE_SRC = r'''
extern "C" __global__ void push_ar4(const float4* __restrict__ x, float4* __restrict__ out,
                                    float4* peer_recv, unsigned* peer_flag,
                                    const float4* my_recv, unsigned* my_flag,
                                    unsigned* epoch_ctr, unsigned* done_ctr, int n4) {
  __shared__ unsigned ep;
  if (threadIdx.x == 0) ep = *((volatile unsigned*)epoch_ctr) + 1;
  __syncthreads();
  unsigned e = ep;
  int par = e & 1;
  int chunk = (n4 + gridDim.x - 1) / gridDim.x;
  int beg = blockIdx.x * chunk, end = min(n4, beg + chunk);
  float4* pr = peer_recv + (size_t)par * n4;
  for (int i = beg + threadIdx.x; i < end; i += blockDim.x) pr[i] = x[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* pf = peer_flag + par * gridDim.x + blockIdx.x;
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" :: "l"(pf), "r"(e) : "memory");
    unsigned* mf = my_flag + par * gridDim.x + blockIdx.x;
    unsigned v;
    do { asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mf) : "memory"); } while (v != e);
  }
  __syncthreads();
  const float4* mr = my_recv + (size_t)par * n4;
  for (int i = beg + threadIdx.x; i < end; i += blockDim.x) {
    float4 a = x[i], b = mr[i];
    out[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned d = atomicAdd(done_ctr, 1u);
    if (d == gridDim.x - 1) { *done_ctr = 0; __threadfence(); atomicAdd(epoch_ctr, 1u); }
  }
}
'''


def symm_worker(rank, port, q, cfg):
    """torch symmetric memory refuses ranks that both call their card device 0 (CUDA_VISIBLE_DEVICES isolation:
    'detected allocations from overlapping devices'), so its one-shot runs in a second phase with both cards
    visible, as in the anchor probe; NCCL is measured there again for reference."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))
    gname = dist.group.WORLD.group_name
    out = {}
    for rows, cols in SIZES:
        n = rows * cols
        r = {}
        y = torch.randn(n, device="cuda")
        r["nccl"] = _graph_time(lambda: dist.all_reduce(y), cfg, dist)
        try:
            t_ = symm_mem.empty(n, device="cuda", dtype=torch.float32)
            symm_mem.rendezvous(t_, gname)
            t_.normal_()
            r["symm_oneshot"] = _graph_time(lambda: torch.ops.symm_mem.one_shot_all_reduce(t_, "sum", gname), cfg,
                                            dist)
        except Exception as ex:
            r["symm_oneshot"] = {"error": repr(ex)[:200]}
        out[f"{rows}x{cols}"] = r
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def _graph_time(fn, cfg, dist):
    import torch
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(st)
    torch.cuda.synchronize()
    dist.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(cfg["per"]):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    ts = []
    for _ in range(cfg["replays"]):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) * 1000 / cfg["per"])
    dist.barrier()
    return report.percentiles(ts, None)


def _spawn_pair(target, cfg, isolate):
    import queue
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = []
    for r in range(2):
        if isolate:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(r)      # each rank sees only its own card
        p = ctx.Process(target=target, args=(r, port, q, cfg))
        p.start()
        ps.append(p)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    out, deadline = {}, time.time() + 400
    while len(out) < 2:                  # a dead worker must not leave us waiting for the full limit
        try:
            rk, val = q.get(timeout=5)
            out[rk] = val
        except queue.Empty:
            dead = [p.exitcode for p in ps if p.exitcode not in (None, 0)]
            if dead or time.time() > deadline:
                for p in ps:
                    if p.is_alive():
                        p.kill()
                print(f"bench phase {target.__name__} failed: worker exit codes {[p.exitcode for p in ps]}",
                      flush=True)
                return None
    for p in ps:
        p.join(timeout=60)
    return out


def worker(rank, port, q, cfg):
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0))
    import cupy as cp
    from dspark_ray.comm.push import PushCollectives, ar_launch_config
    PER, REPLAYS = cfg["per"], cfg["replays"]

    def graph_time(fn, pc=None, n_per=PER):
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(st)
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        if pc is not None:
            with pc.graph_capture() as cap:
                with torch.cuda.graph(g):
                    for _ in range(n_per):
                        fn()
            n = cap.n_collectives
        else:
            with torch.cuda.graph(g):
                for _ in range(n_per):
                    fn()
            n = 0
        torch.cuda.synchronize()
        dist.barrier()

        def rep():
            if pc is not None:
                pc.guard.before_replay(n)
            g.replay()
        for _ in range(5):
            rep()
        torch.cuda.synchronize()
        dist.barrier()
        ts = []
        for _ in range(REPLAYS):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if pc is not None:
                pc.guard.before_replay(n)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1000 / n_per)
        dist.barrier()
        if pc is not None:
            pc.check_error()
        del g
        return report.percentiles(ts, None)

    def connect(pc):
        hs = [None, None]
        dist.all_gather_object(hs, pc.export_handle().to_dict())
        pc.connect(hs[1 - rank], barrier=dist.barrier)
        return pc

    pcs = {
        "flag": connect(PushCollectives(rank)),                       # defaults: relaxed acks, tagged exchange
        "lamport": connect(PushCollectives(rank, allreduce="lamport")),
        "flag_strict": connect(PushCollectives(rank, strict_acks=True)),
        "xflag": connect(PushCollectives(rank, exchange="flag")),
        "flag_ackrel": connect(PushCollectives(rank, ack_release=True)),
        "lamport_ackrel": connect(PushCollectives(rank, allreduce="lamport", ack_release=True)),
    }

    def joint_best(sw):
        """The configuration both ranks run fastest (max of the two p50s): both must launch the same shape."""
        both = [None, None]
        dist.all_gather_object(both, sw)
        cand = {k: max(both[0][k], both[1][k]) for k in sw
                if isinstance(both[0].get(k), float) and isinstance(both[1].get(k), float)}
        return min(cand, key=cand.get) if cand else None
    for pc in pcs.values():
        pc.set_peer_id_range((64768, 129280) if rank == 0 else (0, 64768))

    # probe state
    rt = cp.cuda.runtime
    probe = cp.RawModule(code=PROBE_SRC, options=("-std=c++17",)).get_function("push_ar4")
    maxn, MAXB = 64 * H, 132
    recv = rt.malloc(2 * maxn * 4)
    flags = rt.malloc(2 * MAXB * 4)
    rt.memset(recv, 0, 2 * maxn * 4)
    rt.memset(flags, 0, 2 * MAXB * 4)
    ctr = torch.zeros(2, dtype=torch.int32, device="cuda")
    objs = [None, None]
    dist.all_gather_object(objs, (bytes(rt.ipcGetMemHandle(recv)), bytes(rt.ipcGetMemHandle(flags))))
    p_recv, p_flags = rt.ipcOpenMemHandle(objs[1 - rank][0]), rt.ipcOpenMemHandle(objs[1 - rank][1])

    def seeded(seed_rank, n):
        g = torch.Generator().manual_seed(1234 + 17 * seed_rank + n)
        return torch.randn(n, generator=g).cuda()

    res, sweeps, wrong = {}, {}, []
    for rows, cols in SIZES:
        n = rows * cols
        key = f"{rows}x{cols}"
        r = {"bytes": n * 4}
        x = seeded(rank, n)
        want = seeded(0, n) + seeded(1, n)
        y = x.clone()
        r["nccl"] = graph_time(lambda: dist.all_reduce(y))
        r["symm_oneshot"] = {"error": "measured in the second (non-isolated) phase"}
        # probe (no safety): n4 = n // 4 vectors only, so 1x2 words runs as 1x4 (16 B)
        np4 = max(1, n // 4)
        px = seeded(rank, np4 * 4)
        pout = torch.empty_like(px)
        sw, full = {}, {}
        for nblk in cfg["blocks"]:
            if nblk > 1 and np4 // nblk < 32:
                continue
            for thr in ((32, 128) if np4 < 1024 else (256, 512)):
                torch.cuda.synchronize()
                dist.barrier()
                rt.memset(flags, 0, 2 * MAXB * 4)
                ctr.zero_()
                torch.cuda.synchronize()
                dist.barrier()

                def pk(nblk=nblk, thr=thr):
                    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
                    with stream:
                        probe((nblk,), (thr,), (px.data_ptr(), pout.data_ptr(), p_recv, p_flags, recv, flags,
                                                ctr.data_ptr(), ctr.data_ptr() + 4, cp.int32(np4)))
                t = graph_time(pk)
                sw[f"b{nblk}t{thr}"] = t["p50"]
                full[f"b{nblk}t{thr}"] = t
        jb = joint_best(sw)
        r["probe_best"] = dict(full[jb], config=jb)
        sweeps[f"probe {key}"] = sw
        # push variants, swept over launch configurations
        def run_push(var, nb, thr):
            pc = pcs[var]
            out_box = []

            def pf():
                out_box.append(pc.all_reduce([x], nblocks=nb, threads=thr))
            t = graph_time(pf, pc)
            ok = all(torch.equal(o.view(torch.int32), want.view(torch.int32)) for o in out_box[-3:])
            if not ok:
                wrong.append(f"{var} {key} b{nb}t{thr}")
            return dict(t, config=f"b{nb}t{thr}", exact=ok)

        for var in ("flag", "lamport"):
            dnb, dthr = ar_launch_config(n, variant=var)
            sw, full = {}, {}
            confs = [(dnb, dthr)] + [(b, t) for b in cfg["blocks"] for t in (256, 512)
                                     if (b, t) != (dnb, dthr) and (b == 1 or (n // 4) // b >= 32)]
            if n <= 1024:
                confs = [(dnb, dthr)]
            for nb, thr in confs:
                t = run_push(var, nb, thr)
                full[t["config"]] = t
                sw[t["config"]] = t["p50"] if t["exact"] else f"WRONG {t['p50']}"
            r[f"push_{var}_default"] = full[f"b{dnb}t{dthr}"]
            jb = joint_best(sw)
            r[f"push_{var}_best"] = full[jb] if jb else {"error": "no exact config"}
            sweeps[f"push_{var} {key}"] = sw
        # strict acks and relaxed acks, at the flag / lamport variant's best configuration
        for var, base in (("flag_strict", "flag"), ("flag_ackrel", "flag"), ("lamport_ackrel", "lamport")):
            bc = r[f"push_{base}_best"].get("config", f"b{dnb}t{dthr}")
            nb, thr = (int(v) for v in bc[1:].split("t"))
            r[f"push_{var}"] = run_push(var, nb, thr)
        res[key] = r
        if rank == 0:
            print(f"[bench] {key}: nccl {r['nccl']['p50']}"
                  f" probe {r['probe_best']['p50']} ({r['probe_best']['config']}) push flag "
                  f"{r['push_flag_default']['p50']} (best {r['push_flag_best'].get('p50')} "
                  f"{r['push_flag_best'].get('config')}) release-acks {r['push_flag_ackrel']['p50']} strict "
                  f"{r['push_flag_strict']['p50']} lamport {r['push_lamport_default']['p50']} (best "
                  f"{r['push_lamport_best'].get('p50')} {r['push_lamport_best'].get('config')}) lamport "
                  f"release-acks {r['push_lamport_ackrel']['p50']}",
                  flush=True)

    # exchanges
    xres = {}
    for n in (1, 4, 20):
        for kind in ("max", "top2"):
            if kind == "top2" and n != 20:
                continue
            key = f"{kind} n={n}"
            g = torch.Generator().manual_seed(77 + n)
            base = [torch.randn(n, generator=g) for _ in range(2)]
            ids = [torch.randint(0, 64768, (n,), generator=g), torch.randint(64768, 129280, (n,), generator=g)]
            v1 = base[rank].cuda()
            v2 = (base[rank] - 1).cuda()
            idx = ids[rank].cuda()
            wm = torch.where(base[1] > base[0], base[1], base[0]).cuda()
            wi = torch.where(base[1] > base[0], ids[1], ids[0]).cuda()
            r = {}
            for var in ("flag", "xflag", "flag_strict", "flag_ackrel"):
                pc = pcs[var]
                box = []
                if kind == "max":
                    fn = lambda pc=pc: box.append(pc.max_exchange([(v1, idx)]))  # noqa: E731
                else:
                    fn = lambda pc=pc: box.append(pc.top2_exchange([(v1, v2, idx)]))  # noqa: E731
                t = graph_time(fn, pc)
                ok = all(torch.equal(o[0], wm) and torch.equal(o[-1], wi) for o in box[-3:])
                name = {"flag": "push_tagged", "xflag": "push_flagged", "flag_strict": "push_tagged_strict",
                        "flag_ackrel": "push_tagged_release_acks"}[var]
                r[name] = dict(t, exact=ok)
                if not ok:
                    wrong.append(f"{name} {key}")
            xres[key] = r
            if rank == 0:
                print(f"[bench] {key}: " + " ".join(f"{k} {v['p50']}" for k, v in r.items()), flush=True)
    # NCCL for 16 bytes as the exchange's baseline (the 1x2 all-reduce above is 8 bytes)
    y = torch.ones(4, device="cuda")
    xres["nccl_all_reduce_16B"] = graph_time(lambda: dist.all_reduce(y))

    q.put((rank, {"results": res, "exchange": xres, "sweeps": sweeps, "wrong": wrong,
                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cupy": cp.__version__,
                  "nccl": str(torch.cuda.nccl.version())}))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/collectives_h200x2.json")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--per", type=int, default=20)
    ap.add_argument("--blocks", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--commit", default=report.commit())
    args = ap.parse_args()
    cfg = {"replays": args.replays, "per": args.per, "blocks": [int(b) for b in args.blocks.split(",")]}
    t0 = time.time()
    out = _spawn_pair(worker, cfg, isolate=True)
    if out is None:
        return 2
    symm = _spawn_pair(symm_worker, cfg, isolate=False) or {0: {}}
    r0, r1 = out[0], out[1]
    for key, r in r0["results"].items():
        if key in symm[0]:
            r["symm_oneshot"] = symm[0][key]["symm_oneshot"]
            r["nccl_non_isolated"] = symm[0][key]["nccl"]
    doc = {
        "what": "per-op us inside CUDA graphs, rank 0 (rank 1's p50 in rank1_p50)",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS", "NCCL_PROTO")},
        "commit": args.commit,
        "config": dict(cfg, method="20 back-to-back per graph replay, events around g.replay(), per-op = /20; "
                                   "p50/p99/min over replays; push with the whole safety protocol on",
                       isolation="CUDA_VISIBLE_DEVICES per rank process (push, probe, nccl); symm_oneshot and "
                                 "nccl_non_isolated from a second phase with both cards visible (symm memory "
                                 "refuses two ranks that both see their card as device 0)"),
        "device": r0["device"], "torch": r0["torch"], "cupy": r0["cupy"], "nccl": r0["nccl"],
        "wall_s": round(time.time() - t0, 1),
        "results": r0["results"], "exchange": r0["exchange"],
        "rank1_p50": {k: {m: v.get("p50") for m, v in d.items() if isinstance(v, dict)}
                      for k, d in r1["results"].items()},
        "sweeps": r0["sweeps"], "wrong": sorted(set(r0["wrong"]) | set(r1["wrong"])),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    # the table
    print(f"\n{'payload':>10} {'NCCL':>7} {'symm':>7} {'probe':>7} {'flag':>7} {'best':>7} {'rel-ack':>7} "
          f"{'strict':>7} {'lamport':>8} {'best':>7} {'rel-ack':>7} {'NCCL/flag':>9} {'NCCL/lamp':>9}")
    for key, r in doc["results"].items():
        fd, ld = r["push_flag_default"]["p50"], r["push_lamport_default"]["p50"]
        print(f"{key:>10} {r['nccl']['p50']:>7} {r['symm_oneshot'].get('p50', 'err'):>7} "
              f"{r['probe_best']['p50']:>7} {fd:>7} {r['push_flag_best'].get('p50'):>7} "
              f"{r['push_flag_ackrel']['p50']:>7} {r['push_flag_strict']['p50']:>7} {ld:>8} "
              f"{r['push_lamport_best'].get('p50'):>7} {r['push_lamport_ackrel']['p50']:>7} "
              f"{round(r['nccl']['p50'] / fd, 2):>9} {round(r['nccl']['p50'] / ld, 2):>9}")
    for key, r in doc["exchange"].items():
        if "p50" in r:
            print(f"{key:>22} {r['p50']}")
        else:
            print(f"{key:>22} " + " ".join(f"{k}={v['p50']}" for k, v in r.items()))
    print("wrong:", doc["wrong"] or "none")
    return 1 if doc["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
