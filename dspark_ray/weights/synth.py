"""A deterministic synthetic checkpoint in the DeepSeek-V4 drafter namespace, plain or EXL3 (docs/exl3.md).

The bytes depend only on (config, seed, SCALES), not the device: an exact integer hash of (seed, name, index), exact
fp32 ops to a uniform, then separate correctly rounded torch ops (no fused multiply-add can form), equal under IEEE.
"""
from __future__ import annotations

import fnmatch
from functools import partial
from typing import Callable
import hashlib
import json
import math
import struct
import sys
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DrafterConfig
from . import exl3
from .inventory import TensorSpec, tensor_specs
from .manifest import DTYPE_TAGS, compute_manifest, write_manifest
from .mix import DEFAULT_MIX, Storage, parse_mix, quantization_config, storage_of


@dataclass(frozen=True)
class Draw:
    """value = center + half * U, U uniform on [-1, 1); `half`, or `std` (divided by sqrt(fan_in) with `per_fan_in`)."""
    center: float = 0.0
    half: float | None = None
    std: float | None = None
    per_fan_in: bool = False

    def half_width(self, shape: tuple[int, ...]) -> float:
        if self.half is not None:
            return self.half
        std = self.std / math.sqrt(shape[-1]) if self.per_fan_in else self.std
        return std * math.sqrt(3.0)


def fan_in(gain: float) -> Draw:        # std = gain / sqrt(fan_in): keeps a Linear's output near the input's scale
    return Draw(std=gain, per_fan_in=True)


def around(center: float, half: float) -> Draw:
    return Draw(center=center, half=half)


def with_std(std: float) -> Draw:
    return Draw(std=std)


# The first fnmatch over the full name wins (`*` crosses dots).
SCALES: list[tuple[str, Draw]] = [
    ("mtp.*.attn.attn_sink",               around(0.0, 1.0)),   # nonzero: the sink term must change softmax
    ("mtp.*.hc_*_fn",                      fan_in(0.02)),       # small mixing logits: base/scale dominate mHC
    ("mtp.*.hc_*_base",                    around(0.0, 0.5)),
    ("mtp.*.hc_*_scale",                   around(1.0, 0.5)),
    ("mtp.*.ffn.gate.bias",                around(0.0, 0.3)),   # selection bias: big enough to move the top-k
    ("*norm.weight",                       around(1.0, 0.1)),
    ("embed.weight",                       with_std(1.0)),
    ("*.markov_head.markov_w1.weight",     with_std(1.0)),
    ("*.markov_head.markov_w2.weight",     fan_in(1.0)),
    ("*.confidence_head.proj.weight",      fan_in(1.0)),
    ("head.weight",                        fan_in(1.0)),
    ("*.ffn.gate.weight",                  fan_in(1.0)),
    ("*.weight",                           fan_in(1.0)),
]


def draw_for(name: str) -> Draw:
    for pattern, draw in SCALES:
        if fnmatch.fnmatchcase(name, pattern):
            return draw
    raise KeyError(f"tensor {name!r}: no SCALES entry matches; add one to dspark_ray/weights/synth.py")


_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 in 16-bit halves: a plain int64 product overflows, which CPU and CUDA need not agree on."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def lowbias32(x):
    """Chris Wellons' "lowbias32" integer hash; works on Python ints and on int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _tensor_keys(seed: int, name: str) -> tuple[int, int]:
    k1 = lowbias32((lowbias32(seed & _M32) ^ zlib.crc32(name.encode())) & _M32)
    return k1, lowbias32(k1 ^ 0x9E3779B9)


def hash32(seed: int, name: str, start: int, count: int, device="cpu") -> torch.Tensor:
    """Elements [start, start+count) of the tensor's 32-bit hashes. Two keyed rounds: with one, two tensors would
    draw the same values at indices that differ by the xor of their keys."""
    if start + count > 1 << 32:
        raise ValueError(f"tensor {name}: {start + count} elements exceeds the 2**32 counter range")
    k1, k2 = _tensor_keys(seed, name)
    x = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return lowbias32(lowbias32(x ^ k1) ^ k2)


def _unit(x: torch.Tensor) -> torch.Tensor:
    u = (x >> 8).to(torch.float32)                  # < 2**24: exact in fp32
    return u.mul_(2.0 ** -23).sub_(1.0)             # power-of-two scale and the -1 are exact


def uniform(seed: int, name: str, start: int, count: int, device="cpu") -> torch.Tensor:
    return _unit(hash32(seed, name, start, count, device))


def draw_values(spec: TensorSpec, seed: int, start: int, count: int, device="cpu", draw: Draw | None = None
                ) -> torch.Tensor:
    d = draw or draw_for(spec.name)
    half = torch.tensor(d.half_width(spec.shape), dtype=torch.float32, device=device)   # rounded once, to fp32
    v = uniform(seed, spec.name, start, count, device).mul_(half)
    if d.center:
        v.add_(torch.tensor(d.center, dtype=torch.float32, device=device))
    return v.to(spec.dtype)


@dataclass(frozen=True)
class StoredSpec:
    """One stored tensor: `make(seed, start, count, device)` gives its flat elements [start, start+count)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[..., torch.Tensor]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _plain(spec: TensorSpec) -> StoredSpec:
    return StoredSpec(spec.name, spec.shape, spec.dtype, partial(draw_values, spec))


def _trellis_words(name: str, seed: int, start: int, count: int, device="cpu") -> torch.Tensor:
    x = hash32(seed, name, start, count, device) >> 16
    return ((x ^ 0x8000) - 0x8000).to(torch.int16)


def _signed_scales(name: str, magnitude: float, seed: int, start: int, count: int, device="cpu") -> torch.Tensor:
    x = hash32(seed, name, start, count, device)
    m = torch.tensor(magnitude, dtype=torch.float32, device=device)
    v = _unit(x).mul_(m * 0.25).add_(m)
    return torch.where((x & 1) == 1, -v, v).to(torch.float16)


def _constant(value: int, dtype: torch.dtype, seed: int, start: int, count: int, device="cpu") -> torch.Tensor:
    return torch.full((count,), value, dtype=torch.int64, device=device).to(torch.int32 if dtype == torch.int32
                                                                             else torch.uint8).view(dtype)


def _exl3_parts(spec: TensorSpec, cfg: DrafterConfig, st: Storage) -> list[StoredSpec]:
    """An EXL3 Linear (wo_a: one per o_group); |suh| |svh| * codebook RMS gives the plain checkpoint's std."""
    key = spec.name[: -len(".weight")]
    out_f, in_f = spec.shape
    prefixes = [key]
    if key.endswith(".attn.wo_a"):
        prefixes, out_f = [f"{key}.slice.{g}" for g in range(cfg.o_groups)], cfg.o_lora_rank
    std = draw_for(spec.name).half_width(spec.shape) / math.sqrt(3.0)
    mag = math.sqrt(std / exl3.codebook_rms(st.codebook))
    words = exl3.tile_words(st.bits)
    parts: list[StoredSpec] = []
    for p in prefixes:
        parts += [StoredSpec(f"{p}.trellis", (in_f // exl3.TILE, out_f // exl3.TILE, words), torch.int16,
                             partial(_trellis_words, f"{p}.trellis")),
                  StoredSpec(f"{p}.suh", (in_f,), torch.float16, partial(_signed_scales, f"{p}.suh", mag)),
                  StoredSpec(f"{p}.svh", (out_f,), torch.float16, partial(_signed_scales, f"{p}.svh", mag))]
        if st.codebook in exl3.MARKERS:
            v = exl3.MARKERS[st.codebook]
            parts.append(StoredSpec(f"{p}.{st.codebook}", (), torch.int32,
                                    partial(_constant, v - (1 << 32) if v >= 1 << 31 else v, torch.int32)))
    return parts


FP8_BLOCK = 128
_E4M3_MAX = 448.0


def _fp8_exponent(spec: TensorSpec, d: Draw) -> int:
    """The smallest e with every drawn value inside e4m3's +-448 * 2**e."""
    if d.center:
        raise ValueError(f"tensor {spec.name}: FP8 storage needs values centred on 0")
    half = torch.tensor(d.half_width(spec.shape), dtype=torch.float32).item()
    e = math.ceil(math.log2(half / _E4M3_MAX))
    while _E4M3_MAX * 2.0 ** e < half:
        e += 1
    while _E4M3_MAX * 2.0 ** (e - 1) >= half:
        e -= 1
    return e


def _fp8_values(spec: TensorSpec, e: int, d: Draw, seed: int, start: int, count: int, device="cpu") -> torch.Tensor:
    v = draw_values(TensorSpec(spec.name, spec.shape, torch.float32, spec.kind), seed, start, count, device, d)
    return v.mul_(2.0 ** -e).to(torch.float8_e4m3fn)          # a power of two: exact, then one e4m3 rounding


def _fp8_parts(spec: TensorSpec, draw: Draw | None = None) -> list[StoredSpec]:
    """DeepSeek's FP8 storage, E4M3 over an E8M0 scale per 128 x 128 block; uniform values let all share one."""
    d = draw or draw_for(spec.name)
    e = _fp8_exponent(spec, d)
    grid = tuple(-(-n // FP8_BLOCK) for n in spec.shape)
    key = spec.name[: -len(".weight")]
    return [StoredSpec(spec.name, spec.shape, torch.float8_e4m3fn, partial(_fp8_values, spec, e, d)),
            StoredSpec(f"{key}.scale", grid, torch.float8_e8m0fnu, partial(_constant, e + 127, torch.float8_e8m0fnu))]


def stored_specs(cfg: DrafterConfig, fmt: str = "bf16", mix: dict[str, Storage] | None = None) -> list[StoredSpec]:
    """Every stored tensor, in inventory order (fmt "exl3": the Linears in the `mix`'s storage forms)."""
    if fmt not in ("bf16", "exl3"):
        raise ValueError(f"format {fmt!r}: must be bf16 or exl3")
    mix = parse_mix(DEFAULT_MIX) if mix is None else mix
    out: list[StoredSpec] = []
    for spec in tensor_specs(cfg).values():
        st = storage_of(spec.name, mix) if fmt == "exl3" else None
        if st is None or st.form == "plain":
            out.append(_plain(spec))
        elif st.form == "fp8":
            out += _fp8_parts(spec)
        else:
            out += _exl3_parts(spec, cfg, st)
    return out


def _header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """Callers put the widest dtypes first and the JSON is padded to 8, so every offset is element-aligned."""
    meta, off = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * dtype.itemsize
        meta[name] = {"dtype": DTYPE_TAGS[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _file_order(specs: list[StoredSpec]) -> list[StoredSpec]:
    return sorted(specs, key=lambda s: -s.dtype.itemsize)      # stable: inventory order within a width


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write a small safetensors file with any dtype in DTYPE_TAGS (FP8/E8M0 too)."""
    path = Path(path)
    items = sorted(tensors.items(), key=lambda kv: -kv[1].dtype.itemsize)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_header([(k, t.dtype, tuple(t.shape)) for k, t in items]))
        for _, t in items:
            f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    tmp.replace(path)       # the tensors may be mmapped views of the file being replaced (safetensors load_file)


def _plan_shards(specs: list[StoredSpec], shard_bytes: int) -> list[list[StoredSpec]]:
    """Greedy in inventory order, so a block's tensors stay together."""
    shards, cur, size = [], [], 0
    for s in specs:
        if cur and size + s.nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        shards.append(cur)
    return shards


DEFAULT_SHARD_BYTES = 4 << 30
_OWNED = ("model*.safetensors", "model.safetensors.index.json", "dspark-manifest.json", "config.json")


def synthesize(cfg: DrafterConfig, out_dir: str | Path, seed: int = 0, device: str | torch.device = "cpu",
               shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool | None = None, fmt: str = "bf16",
               bits: str = DEFAULT_MIX) -> dict:
    """Write the checkpoint and its manifest (returned); `progress=None`: a bar above 1 GB on a terminal."""
    mix = parse_mix(bits) if fmt == "exl3" else None
    config = cfg.to_json_dict()
    if mix is not None:
        config["quantization_config"] = quantization_config(mix)
    return write_checkpoint(stored_specs(cfg, fmt, mix), config, cfg.digest(), out_dir, seed=seed, device=device,
                            shard_bytes=shard_bytes, progress=progress)


def write_checkpoint(specs: list[StoredSpec], config: dict, config_digest: str, out_dir: str | Path, *, seed: int = 0,
                     device: str | torch.device = "cpu", shard_bytes: int = DEFAULT_SHARD_BYTES,
                     progress: bool | None = None, listed: Callable[[str], bool] = lambda name: True) -> dict:
    """Stream `specs` into shards beside config.json; the manifest lists the tensors `listed` selects."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for pattern in _OWNED:                          # stale shards of an earlier layout would be found by a glob
        for p in out.glob(pattern):
            p.unlink()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    shards = _plan_shards(specs, shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(s.nbytes for s in specs)
    dev = torch.device(device)
    # Big enough to keep a GPU busy; on a CPU, small enough for the hash's int64 temporaries to stay in cache.
    chunk = (1 << 26) if dev.type == "cuda" else (1 << 18)
    bar = None
    if progress or (progress is None and total > 1 << 30 and sys.stderr.isatty()):
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"synth {out.name}")

    # Draw, write and hash overlap (both drop the GIL); one worker each keeps file and hash in order.
    records: dict[str, dict] = {}
    pending: deque = deque()
    with ThreadPoolExecutor(1) as writer, ThreadPoolExecutor(1) as hasher:
        def write(f, buf):
            f.write(buf)
            if bar is not None:
                bar.update(len(buf))

        for fname, shard in zip(names, shards):
            order = _file_order(shard)
            f = open(out / fname, "wb")
            f.write(_header([(s.name, s.dtype, s.shape) for s in order]))
            for s in order:
                h = hashlib.sha256()
                for start in range(0, s.numel, chunk):
                    vals = s.make(seed, start, min(chunk, s.numel - start), dev)
                    buf = vals.cpu().view(torch.uint8).numpy()
                    pending.append(writer.submit(write, f, buf))
                    pending.append(hasher.submit(h.update, buf))
                    while len(pending) > 8:     # bound host memory: at most ~4 chunks in flight
                        pending.popleft().result()
                records[s.name] = {"shape": list(s.shape), "dtype": DTYPE_TAGS[s.dtype],
                                   "sha256": hasher.submit(h.hexdigest)}
            pending.append(writer.submit(f.close))
        while pending:
            pending.popleft().result()
    if bar is not None:
        bar.close()
    for r in records.values():
        r["sha256"] = r["sha256"].result()

    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {s.name: fname for fname, shard in zip(names, shards) for s in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    manifest = compute_manifest(config_digest, {n: r for n, r in records.items() if listed(n)})
    write_manifest(out, manifest)                   # last: its presence says the checkpoint is complete
    return manifest
