"""Would a graph launched before its inputs exist save the launch from a STEP's path? A probe (GPU only).

A rank now stages a STEP's inputs into pinned memory, then launches the step graph (host: 30 us on a pair rank in
the service, 9 us for one process alone), and the graph's first kernel copies the inputs in. The alternative
probed here: launch the graph ahead, while the rank waits for the next STEP; its upload kernel polls a word in
pinned host memory (`ld.acquire.sys`) until the host, having staged the inputs, writes the replay's number there.
No launch, and no graph start, is then left between the STEP's arrival and the GPU's work.

Both ways time the same graph (an upload of `--bytes` from pinned memory, `--kernels` small kernels, a checksum of
what was uploaded, a download of it and of the replay count), from the moment the host starts writing a replay's
inputs until it sees the replay's download, with `--gap-us` of host spinning between replays (a serving engine's
STEPs come 10-50 ms apart; the ahead-launched graph waits on the GPU meanwhile). Every replay's checksum must match
what the host wrote for it: the poll's acquire orders the input reads after the flag.

    python bench/prelaunch_probe.py [--reps 500] [--gap-us 300] [--out bench/results/gpu/prelaunch_probe_h200.json]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import kernel_bench  # noqa: E402
from bench.tcp_roundtrip import emit  # noqa: E402

BLOCK = 4096
MAX_POLLS = 1 << 22          # a poll crosses PCIe (~1 us): a released graph never waits this long


@triton.jit
def _ld_acquire_sys(addr):
    return tl.inline_asm_elementwise("ld.acquire.sys.global.u32 $0, [$1];", "=r,l", [addr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _released_copy_kernel(flag_ptr, seen_ptr, src_ptr, dst_ptr, n, max_polls, BLOCK: tl.constexpr):
    """Program i: wait until the host's flag reads this replay's number (the device's count of replays so far,
    plus one), then copy bytes [i * BLOCK, (i + 1) * BLOCK). After max_polls it gives up and copies nothing (the
    checksum then tells)."""
    want = tl.load(seen_ptr) + 1
    addr = (flag_ptr + tl.arange(0, 2) * 0).to(tl.int64)      # two lanes, one word: a block shape for the asm
    v = tl.max(_ld_acquire_sys(addr), axis=0)
    polls = 0
    while (v != want) & (polls < max_polls):
        v = tl.max(_ld_acquire_sys(addr), axis=0)
        polls += 1
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < n) & (v == want)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


def main(argv=None) -> int:
    def extra(ap):
        ap.add_argument("--bytes", type=int, default=92160, help="inputs a replay uploads (a 3-row STEP's taps)")
        ap.add_argument("--kernels", type=int, default=100, help="small kernels after the upload")
        ap.add_argument("--gap-us", type=float, default=300.0, help="host spin between replays")
    started = kernel_bench.start("prelaunch_probe", __doc__, 500, argv, extra=extra)
    if started is None:
        return 2
    args, dev, _ = started
    from dspark_ray.kernels.host_copy import Address, copy_bytes
    n = args.bytes
    src = torch.zeros(n, dtype=torch.uint8, pin_memory=True)
    flag = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    out = torch.zeros(2, dtype=torch.int64, pin_memory=True)           # [replays seen, checksum]
    src_np, flag_np, out_np = src.numpy(), flag.numpy(), out.numpy()
    dst = torch.zeros(n, dtype=torch.uint8, device=dev)
    seen = torch.zeros(1, dtype=torch.int32, device=dev)
    work = torch.zeros(1024, dtype=torch.float32, device=dev)
    res_dev = torch.zeros(2, dtype=torch.int64, device=dev)

    def body():
        _released_copy_kernel[(triton.cdiv(n, BLOCK),)](Address(flag.data_ptr()), seen, Address(src.data_ptr()),
                                                        dst, n, MAX_POLLS, BLOCK=BLOCK, num_warps=4)
        seen.add_(1)
        for _ in range(args.kernels):
            work.add_(1.0)
        res_dev[0] = seen[0]
        res_dev[1] = dst.sum()
        copy_bytes(res_dev, (out.data_ptr(), res_dev.data_ptr(), 16))

    count = 0

    def release(i: int) -> None:        # the host's part of a replay: the inputs, then the flag
        src_np.fill(i % 251)
        flag_np[0] = count

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):          # compile and load everything outside the capture
        count += 1
        release(0)
        body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()

    def spin(us: float) -> None:
        end = time.perf_counter_ns() + int(us * 1e3)
        while time.perf_counter_ns() < end:
            pass

    def wait_done(want: int) -> None:
        deadline = time.perf_counter_ns() + 2_000_000_000
        while out_np[0] != want:
            if time.perf_counter_ns() > deadline:
                raise TimeoutError(f"replay {want} not downloaded in 2 s")

    res = kernel_bench.header("prelaunch_probe", {"bytes": n, "kernels": args.kernels, "gap_us": args.gap_us,
                                                  "reps": args.reps}, modes={})
    for mode in ("launch_after", "ahead", "launch_after", "ahead"):
        times, launch, bad = [], [], 0
        for i in range(args.reps + 20):
            count += 1
            if mode == "ahead":
                g.replay()                                    # launched while the host waits for the STEP
            spin(args.gap_us)
            t0 = time.perf_counter_ns()
            release(count)
            if mode == "launch_after":
                t1 = time.perf_counter_ns()
                g.replay()
                launch.append((time.perf_counter_ns() - t1) / 1e3)
            wait_done(count)
            t = (time.perf_counter_ns() - t0) / 1e3
            torch.cuda.synchronize()              # the download's other word may land a moment later
            bad += int(out_np[1] != n * (count % 251))
            if i >= 20:
                times.append(t)
        row = res["modes"].setdefault(mode, {"runs": []})
        row["runs"].append({**kernel_bench.stats(times), "bad_checksums": bad,
                            **({"launch_call_p50_us": round(statistics.median(launch), 2)} if launch else {})})
        print(f"prelaunch_probe: {mode}: {row['runs'][-1]}", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    a = [r["p50_us"] for r in res["modes"]["launch_after"]["runs"]]
    b = [r["p50_us"] for r in res["modes"]["ahead"]["runs"]]
    res["ahead_minus_launch_after_p50_us"] = [round(y - x, 2) for x, y in zip(a, b)]
    emit(res, args.out, 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
