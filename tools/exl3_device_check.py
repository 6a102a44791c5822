"""GPU + exllamav3 1.6.5: our torch EXL3 decode (dspark_ray/weights/exl3.py) against exllamav3's own kernels, and
exllamav3 loading our synthetic EXL3 checkpoint as its DeepSeek-V4 drafter. Prints one JSON object; exits 1 when a
bit-exact check fails or exllamav3 cannot load and run seed 000's mix.

    source .devbundle/setup.sh && python tools/exl3_device_check.py [--out DIR] [--preset tiny] [--rounds 12]

(bundle: `make-bundle.sh --exl3`, carry [".devbundle"]). Per checkpoint (seed 000's mix, and one with every stored
kind: the three codebooks, 1..8 bits and the half rates, EXL3 wo_a slices), for every EXL3 Linear:
  inner   exllamav3_ext.reconstruct (LinearEXL3.get_inner_weight_tensor) == exl3.inner_weight on the CPU, bit for bit
  fused   exllamav3_ext.reconstruct_had_slice == exl3.reconstruct on the CPU and on the GPU, bit for bit
  cuts    every rank's layout cut (trellis tiles + suh / svh at 128-channel boundaries, as exllamav3's tensor split
          cuts them), reconstruct_had_slice'd == the full decode's slice, bit for bit
  torch   LinearEXL3.get_weight_tensor() (its Hadamards as fp32 cuBLAS GEMMs, another rounding): how many weights
          differ and by how much (informational; its GEMM order is cuBLAS's, not reproducible off the card)
The tiny checkpoints are also drawn on the CPU: the same identity digest. Then exllamav3's DeepseekV4MTPModel (Config.from_directory, Model.from_config(component="mtp"), a paged Cache, load,
its own embedding and head) inserts tap rows (update_kv_from_target) and drafts rounds (forward, sample_from_state)
beside our split reference on the same inputs: drafts equal per round, our margin at each first mismatch (a small
one is a near-tie: exllamav3's EXL3 GEMMs round differently from a dequantized fp16 GEMM).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dspark_ray.config import preset  # noqa: E402
from dspark_ray.model.layout import Layout  # noqa: E402
from dspark_ray.testing.workload import rounds_for  # noqa: E402
from dspark_ray.weights import exl3  # noqa: E402
from dspark_ray.weights.loader import Checkpoint  # noqa: E402
from dspark_ray.weights.mix import DEFAULT_MIX  # noqa: E402
from dspark_ray.weights.synth import synthesize  # noqa: E402

# Every stored kind (tests/test_exl3.py's KINDS_MIX): wq_b 5 bpw 3INST... wkv at 2.5 bpw is a half rate, which
# exllamav3 keeps off its DSV4 attention projections (q_half_bits = False), so its forward may refuse this one.
KINDS_MIX = "head=6:3inst,experts=1mcg,wo_a=3mcg,wq_b=5,wkv=2.5mul1,shared=1.5mul1,wo_b=8:3inst,wq_a=16,rest=7mcg"
PAGE = 256


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int16)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    ne = _bits(a.cpu()) != _bits(b.cpu())
    return {"differ": int(ne.sum()), "max_abs": float((a.cpu().float() - b.cpu().float()).abs().max())}


def _linear(rec: exl3.Exl3Linear, dev, key: str):
    from exllamav3.modules.quant.exl3 import LinearEXL3
    marks = {c: torch.tensor(v, dtype=torch.uint32).view(torch.int) for c, v in exl3.MARKERS.items()}
    return LinearEXL3(None, rec.in_features, rec.out_features, None, None, None, rec.suh.to(dev), rec.svh.to(dev),
                      rec.trellis.to(dev), marks["mcg"] if rec.codebook == "mcg" else None,
                      marks["mul1"] if rec.codebook == "mul1" else None, None, torch.half, key=key)


def _fused(lin) -> torch.Tensor:
    from exllamav3.ext import exllamav3_ext as ext
    w = torch.empty((lin.in_features, lin.out_features), dtype=torch.half, device=lin.trellis.device)
    ext.reconstruct_had_slice(w, lin.trellis, lin.suh, lin.svh, lin.K, lin.mcg, lin.mul1, 0)
    return w


def check_decode(ck: Checkpoint, dev, cpu_per_kind: int | None) -> dict:
    """inner / fused / torch per EXL3 Linear, cuts per rank; totals and the first failures. The CPU decode runs on
    at most `cpu_per_kind` Linears of each bitrate + codebook (None: all; the full preset's 15 G weights would take
    the CPU an hour), the GPU one (the same torch code) on all."""
    lay = Layout(ck.config, 2)
    out = {"linears": 0, "cpu_checked": 0, "cuts": 0, "inner_equal": 0, "fused_equal_cpu": 0, "fused_equal_gpu": 0,
           "cuts_equal": 0, "torch_differ_weights": 0, "torch_max_abs": 0.0, "kinds": {}, "failures": []}
    for name in ck.names():
        if ck.storage(name) != "exl3":
            continue
        for i, rec in enumerate(ck.exl3(name)):
            key = f"{name}[{i}]"
            lin = _linear(rec, dev, key)
            kind = f"{rec.K}:{rec.codebook}"
            out["kinds"][kind] = out["kinds"].get(kind, 0) + 1
            out["linears"] += 1
            fused, gpu = _fused(lin), rec.to(dev)
            checks = {"fused_equal_gpu": (gpu.weight(), fused)}
            if cpu_per_kind is None or out["kinds"][kind] <= cpu_per_kind:
                out["cpu_checked"] += 1
                checks["inner_equal"] = (exl3.inner_weight(rec.trellis, rec.codebook), lin.get_inner_weight_tensor())
                checks["fused_equal_cpu"] = (rec.weight(), fused)
            for what, (a, b) in checks.items():
                d = _diff(a, b)
                if d["differ"] == 0:
                    out[what] += 1
                elif len(out["failures"]) < 20:
                    out["failures"].append({"tensor": key, "check": what, "kind": kind, **d})
            t = _diff(checks["fused_equal_gpu"][0], lin.get_weight_tensor())
            out["torch_differ_weights"] += t["differ"]
            out["torch_max_abs"] = max(out["torch_max_abs"], t["max_abs"])
        full = ck.read(name, device=dev)
        for r in (0, 1):
            s = lay.slice_of(name, tuple(full.shape), r)
            if s is None:
                continue
            dim, a, b = s
            got = torch.cat([_fused(_linear(x, dev, name)).T for x in ck.exl3(name, dim, a, b)])
            d = _diff(got, full.narrow(dim, a, b - a))
            out["cuts"] += 1
            if d["differ"] == 0:
                out["cuts_equal"] += 1
            elif len(out["failures"]) < 20:
                out["failures"].append({"tensor": name, "check": f"cut rank {r} dim {dim} [{a}, {b})", **d})
    out["ok"] = (out["inner_equal"] == out["fused_equal_cpu"] == out["cpu_checked"]
                 and out["fused_equal_gpu"] == out["linears"] and out["cuts_equal"] == out["cuts"])
    return out


def check_forward(d: Path, ck: Checkpoint, dev, n_rounds: int, ref_device) -> dict:
    """exllamav3 loads the checkpoint as its drafter and drafts; our split reference (on `ref_device`) drafts the same
    rounds."""
    from exllamav3 import Cache, Config, Model

    from dspark_ray.rank.modes import make_drafter
    cfg = ck.config
    rounds = rounds_for(cfg, n_rounds, 0)
    pages = -(-(sum(n for _, n, _, _ in rounds) + cfg.block_size + 1) // PAGE)
    t0 = time.perf_counter()
    config = Config.from_directory(str(d))
    model = Model.from_config(config, component="mtp")
    cache = Cache(model, max_num_tokens=pages * PAGE)
    model.load(str(dev))
    model._load_own_embed_head()            # the trunk's embedding and head, the drafter's own copies
    load_s = time.perf_counter() - t0
    ref = make_drafter(cfg, "split", ckpt=ck, device=ref_device)
    st = ref.new_slot()
    block_table = torch.arange(pages, dtype=torch.int32).unsqueeze(0)
    h = cfg.hidden_size
    res = {"load_s": round(load_s, 2), "rounds": [], "blocks_equal": 0, "positions_equal": 0, "positions": 0,
           "confident_len_equal": 0}
    for start, n, taps, seed in rounds:
        x_taps = [taps[:, t * h:(t + 1) * h].unsqueeze(0).to(dev) for t in range(cfg.n_taps)]
        model.update_kv_from_target(x_taps, cache, {"block_table": block_table,
                                                    "cache_seqlens": torch.tensor([start], dtype=torch.int32)},
                                    lengths=[n])
        p0 = start + n
        params = {"attn_mode": "flash_attn", "block_table": block_table, "cache": cache,
                  "cache_seqlens": torch.tensor([p0], dtype=torch.int32)}
        state = model.forward(torch.tensor([[seed]], dtype=torch.long), params)
        theirs = model.sample_from_state(state, params)[0, 1:].cpu()
        ref.insert(st, start, taps.to(ref_device))
        r = ref.draft([st], [seed], cfg.block_size, want_margins=True)
        ours = r.drafts[0].cpu()
        eq = (ours == theirs)
        first = int((~eq).nonzero()[0]) if not bool(eq.all()) else None
        res["rounds"].append({"p0": p0, "ours": ours.tolist(), "exllamav3": theirs.tolist(),
                              "confident_len": [int(r.confident_len[0]), int(params["draft_confidence_len"])],
                              "first_mismatch": first,
                              "our_margin_there": None if first is None else float(r.margins[0, first])})
        res["blocks_equal"] += int(bool(eq.all()))
        res["positions_equal"] += int(eq.cumprod(0).sum())          # equal up to the first mismatch
        res["positions"] += len(eq)
        res["confident_len_equal"] += int(int(r.confident_len[0]) == int(params["draft_confidence_len"]))
    model.unload()
    return res


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="where the synthetic checkpoints go (default: a temporary dir)")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--cpu-per-kind", type=int, default=None,
                    help="CPU decode checks per bitrate + codebook (default: all for tiny, 2 for full)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 2
    import exllamav3
    dev = torch.device("cuda:0")
    torch.set_num_threads(8)
    base = Path(a.out or tempfile.mkdtemp(prefix="exl3_check_"))
    report = {"config": {"preset": a.preset, "rounds": a.rounds}, "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "exllamav3": exllamav3.__version__ if hasattr(exllamav3, "__version__")
              else "1.6.5", "commit": _commit(), "checkpoints": {}}
    ok = True
    for tag, mix, must_run in (("seed000_mix", DEFAULT_MIX, True), ("every_kind", KINDS_MIX, False)):
        d = base / tag
        t0 = time.perf_counter()
        synthesize(preset(a.preset), d, fmt="exl3", bits=mix, device=dev)
        ck = Checkpoint(d)
        entry = {"mix": mix, "synth_s": round(time.perf_counter() - t0, 2), "identity": ck.identity_digest}
        if a.preset == "tiny":              # the bytes do not depend on the device that drew them
            cpu = synthesize(preset(a.preset), base / f"{tag}_cpu", fmt="exl3", bits=mix, device="cpu")
            entry["cpu_synth_same_identity"] = cpu["identity_digest"] == ck.identity_digest
            ok &= entry["cpu_synth_same_identity"]
        per_kind = a.cpu_per_kind if a.cpu_per_kind is not None else (None if a.preset == "tiny" else 2)
        entry["decode"] = check_decode(ck, dev, per_kind)
        ok &= entry["decode"]["ok"]
        if not a.skip_forward:
            try:
                entry["forward"] = check_forward(d, ck, dev, a.rounds, "cpu" if a.preset == "tiny" else dev)
            except Exception as e:          # noqa: BLE001 - reported; fatal only for seed 000's mix
                entry["forward"] = {"error": f"{type(e).__name__}: {e}"}
                ok &= not must_run
        report["checkpoints"][tag] = entry
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
