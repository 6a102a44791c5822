"""`dspark-ray synth`: a synthetic checkpoint (`synth.py`), or with `--with-trunk` a whole model an engine runs
(`engine_model.py`). Apart from both so that neither imports the other."""
from __future__ import annotations

import argparse
import sys
import time

import torch

from ..argtypes import NON_NEGATIVE_INT, POSITIVE_S, number
from ..config import preset
from .engine_model import write_engine_model
from .mix import DEFAULT_MIX, MixError, parse_mix
from .synth import DEFAULT_SHARD_BYTES, synthesize


def synth_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dspark-ray synth", description="Write a deterministic synthetic checkpoint.")
    ap.add_argument("--preset", choices=["tiny", "full"], required=True)
    ap.add_argument("--out", required=True, help="checkpoint directory (created; earlier model files replaced)")
    ap.add_argument("--seed", type=NON_NEGATIVE_INT, default=0)
    ap.add_argument("--device", default=None, help="where values are drawn (default: cuda if present, else cpu); "
                                                   "the bytes are the same either way")
    ap.add_argument("--shard-gb", type=POSITIVE_S, default=DEFAULT_SHARD_BYTES / (1 << 30),
                    help="largest shard in GiB (default %(default)s)")
    ap.add_argument("--format", choices=["bf16", "exl3"], default="bf16",
                    help="bf16: plain tensors; exl3: the Linears as exllamav3 1.6.5 stores them (default %(default)s)")
    ap.add_argument("--bits", default=None, help=f"with --format exl3: the storage mix, group=value,... "
                                                 f"(default {DEFAULT_MIX!r}; weights/mix.py lists the groups)")
    ap.add_argument("--with-trunk", action="store_true",
                    help="a whole model an engine runs: the preset's drafter over a small sliding-window trunk, a "
                         "tokenizer, trunk and drafter agreeing on a bigram (weights/engine_model.py; exllamav3 "
                         "loads it as DeepseekV4ForCausalLM)")
    ap.add_argument("--disagree", type=number(float, 0, 1), default=0.25,
                    help="with --with-trunk: the share of ids whose next token the drafter predicts differently "
                         "(sets the acceptance; default %(default)s)")
    a = ap.parse_args(argv)
    if a.with_trunk and a.format != "bf16":
        ap.error("--with-trunk writes its own storage (FP8 Linears at full width): leave --format out")
    if not a.with_trunk and a.disagree != 0.25:
        ap.error("--disagree: only with --with-trunk")
    if a.bits is not None and a.format != "exl3":
        ap.error(f"--bits {a.bits}: only with --format exl3")
    bits = a.bits or DEFAULT_MIX
    try:
        parse_mix(bits)
    except MixError as e:
        ap.error(str(e))
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    if a.with_trunk:
        m = write_engine_model(a.preset, a.out, seed=a.seed, disagree=a.disagree, device=device,
                               shard_bytes=int(a.shard_gb * (1 << 30)))
        print(f"wrote {a.out}: trunk and drafter, preset {a.preset}, disagree {a.disagree}, seed {a.seed}, device "
              f"{device}, {time.perf_counter() - t0:.1f} s\nidentity_digest {m['identity_digest']}\n"
              f"config_digest {m['config_digest']}")
        return 0
    m = synthesize(preset(a.preset), a.out, seed=a.seed, device=device, shard_bytes=int(a.shard_gb * (1 << 30)),
                   fmt=a.format, bits=bits)
    fmt = a.format + (f" ({bits})" if a.format == "exl3" else "")
    print(f"wrote {a.out}: {len(m['tensors'])} tensors, preset {a.preset}, format {fmt}, seed {a.seed}, device "
          f"{device}, {time.perf_counter() - t0:.1f} s\nidentity_digest {m['identity_digest']}\n"
          f"config_digest {m['config_digest']}")
    return 0


if __name__ == "__main__":
    sys.exit(synth_main())
