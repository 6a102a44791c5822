"""Read a DeepSeek-V4 drafter checkpoint (bf16, FP8, FP4 or EXL3: docs/exl3.md) into the compute form of
inventory.COMPUTE_RULES. A slice read touches only its rows/columns on disk (widened to whole scale or Hadamard
blocks) and equals the same slice of a full read, so a rank never loads the half it does not own.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import DrafterConfig, load_config
from . import exl3
from .inventory import fallback_names, kind_of, optional_specs, tensor_specs
from .manifest import (MANIFEST_NAME, ManifestError, StoredTensor, check_content, check_layout, compute_manifest,
                       read_manifest, records_from_files, scan_safetensors)


class CheckpointError(ValueError):
    """The checkpoint cannot serve the config."""


_FLOAT_TAGS = {"F16", "BF16", "F32", "F64"}
_STAGED_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_FP8_TAGS = {"F8_E4M3"}
_FP4_TAGS = {"I8", "U8"}                    # two e2m1 codes per byte
_SCALE_TAGS = {"F8_E8M0", "U8", "F32", "BF16", "F16"}
# e2m1 magnitudes for codes 0..7; bit 3 of a code is the sign (spec section 2).
_FP4_LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# EXL3 components and exllamav3's per-group wo_a Linears name a tensor of the namespace.
_EXL3_PART = re.compile(r"\.(trellis|suh|svh|su|sv|mcg|mul1)$")
_WO_A_SLICE = re.compile(r"\.wo_a\.slice\.\d+$")


def canonical_name(stored: str) -> str:
    """The namespace tensor a stored tensor belongs to (`X.scale`, `X.trellis`, `wo_a.slice.<g>.*` -> `X.weight`)."""
    if stored.endswith(".scale"):
        return stored[: -len(".scale")] + ".weight"
    m = _EXL3_PART.search(stored)
    base = stored[: m.start()] if m else stored[: -len(".weight")] if stored.endswith(".weight") else None
    if base is None:
        return stored
    return _WO_A_SLICE.sub(".wo_a", base) + ".weight"


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 block scales; E8M0 bytes b built as the exact fp32 bit pattern of 2**(b-127) (0: subnormal, 255: NaN)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        b = scale.view(torch.uint8).to(torch.int32)
        bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
        v = bits.view(torch.float32)
        return torch.where(b == 255, torch.full_like(v, float("nan")), v)
    return scale.to(torch.float32)


def decode_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(R, C/2) bytes -> (R, C) fp32 e2m1 values; the low nibble is the even column."""
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)
    lut = torch.tensor(_FP4_LUT, dtype=torch.float32, device=packed.device)
    mag = lut[codes & 7]
    return torch.where(codes & 8 != 0, -mag, mag)


def _apply_scales(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Times each block's power-of-two scale, exact in fp32, then one fp16 rounding."""
    s = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (values * s[: values.shape[0], : values.shape[1]]).to(torch.float16)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    block = (_block_len(weight.shape[0], scale.shape[0]), _block_len(weight.shape[1], scale.shape[1]))
    return _apply_scales(weight.to(torch.float32), scale_values(scale), block)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    values = decode_fp4(packed)
    block = (_block_len(values.shape[0], scale.shape[0]), _block_len(values.shape[1], scale.shape[1]))
    return _apply_scales(values, scale_values(scale), block)


def _block_len(n: int, groups: int, what: str = "weight") -> int:
    """n / groups when it divides, else the power of two giving `groups` blocks (DeepSeek's shapes may not divide)."""
    if groups <= 0 or groups > n:
        raise CheckpointError(f"{what}: scale grid of {groups} blocks does not fit a dimension of {n}")
    if n % groups == 0:
        return n // groups
    b = 1
    while math.ceil(n / b) > groups:
        b *= 2
    if math.ceil(n / b) != groups:
        raise CheckpointError(f"{what}: cannot derive a block length: {n} elements in {groups} scale blocks")
    return b


class Checkpoint:
    def __init__(self, path: str | Path, verify_content: bool = False):
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise CheckpointError(f"{self.path}: no config.json")
        self.config: DrafterConfig = load_config(self.path)
        self._stored = self._find_tensors()
        cfg = self.config
        self._specs = tensor_specs(cfg)
        self._optional = optional_specs(cfg)
        self._alias = fallback_names(cfg)
        self._handles: dict[Path, object] = {}
        self._parts = self._find_parts()
        self._codebooks: dict[str, str] = {}
        self.manifest = read_manifest(self.path)
        if self.manifest is not None:
            if self.manifest["config_digest"] != cfg.digest():
                raise ManifestError(f"config_digest: config.json gives {cfg.digest()}, {MANIFEST_NAME} says "
                                    f"{self.manifest['config_digest']} (the config changed after the weights)")
            check_layout(self.manifest, self._stored, keep=self._is_drafter)
            if verify_content:
                check_content(self.manifest, self._stored)
        elif verify_content:
            raise ManifestError(f"{self.path}: verify_content asked, but there is no {MANIFEST_NAME} to verify against")
        self._identity = self.manifest["identity_digest"] if self.manifest else None
        self._check_inventory()

    def _find_tensors(self) -> dict[str, StoredTensor]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({self.path / f for f in weight_map.values()})
        elif (self.path / "model.safetensors").exists():
            weight_map, files = None, [self.path / "model.safetensors"]
        else:
            weight_map, files = None, sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no model.safetensors, index or *.safetensors file")
        stored: dict[str, StoredTensor] = {}
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index.name}: names file {f.name}, which does not exist")
            for t in scan_safetensors(f):
                if t.name in stored:
                    raise CheckpointError(f"tensor {t.name}: stored twice, in {stored[t.name].path.name} "
                                          f"and {f.name}")
                stored[t.name] = t
        for name, fname in (weight_map or {}).items():
            if name not in stored or stored[name].path.name != fname:
                raise CheckpointError(f"tensor {name}: the index places it in {fname}, but it is not there")
        return stored

    def _is_drafter(self, name: str) -> bool:
        """A tensor the drafter reads (real checkpoints also hold the trunk's)."""
        name = canonical_name(name)
        return name in self._specs or name in self._optional or name in self._alias.values()

    def _find_parts(self) -> dict[str, list[str]]:
        """EXL3 or wo_a-slice Linears: name -> their stored prefixes in row order (wo_a: one per group)."""
        out: dict[str, list[str]] = {}
        for name, spec in self._specs.items():
            if spec.kind != "linear":
                continue
            key = name[: -len(".weight")]
            if f"{key}.trellis" in self._stored:
                out[name] = [key]
            elif name.endswith(".attn.wo_a.weight") and any(f"{key}.slice.0.{p}" in self._stored
                                                             for p in ("trellis", "weight")):
                out[name] = [f"{key}.slice.{g}" for g in range(self.config.o_groups)]
            else:
                continue
            if name in self._stored:
                raise CheckpointError(f"tensor {name}: stored twice, as {name} and as EXL3 / slices "
                                      f"({out[name][0]}.*); a checkpoint holds one form")
            for prefix in out[name]:
                self._check_part(prefix)
        return out

    def _check_part(self, prefix: str) -> None:
        st = self._stored
        if f"{prefix}.trellis" not in st:
            if f"{prefix}.weight" not in st:
                raise CheckpointError(f"tensor {prefix}: wo_a group slice missing (neither {prefix}.trellis nor "
                                      f"{prefix}.weight)")
            if st[f"{prefix}.weight"].dtype not in _FLOAT_TAGS:
                raise CheckpointError(f"tensor {prefix}.weight: dtype {st[f'{prefix}.weight'].dtype}, a wo_a slice "
                                      f"must be a float type or EXL3")
            return
        t = st[f"{prefix}.trellis"]
        if t.dtype != "I16" or len(t.shape) != 3:
            raise CheckpointError(f"tensor {prefix}.trellis: {t.dtype} {list(t.shape)}, EXL3 needs int16 "
                                  f"(in/16, out/16, 16*K)")
        try:
            K = exl3.bits_of(t.shape[2])
        except exl3.Exl3Error as e:
            raise CheckpointError(f"tensor {prefix}.trellis: {e}") from None
        k, n = t.shape[0] * exl3.TILE, t.shape[1] * exl3.TILE
        if k % exl3.HAD or n % exl3.HAD:
            raise CheckpointError(f"tensor {prefix}.trellis: a ({k}, {n}) weight; EXL3 dims are multiples of "
                                  f"{exl3.HAD}")
        for side, size in (("u", k), ("v", n)):
            scaled, signs = st.get(f"{prefix}.s{side}h"), st.get(f"{prefix}.s{side}")
            if scaled is not None and (scaled.dtype != "F16" or scaled.shape != (size,)):
                raise CheckpointError(f"tensor {prefix}.s{side}h: {scaled.dtype} {list(scaled.shape)}, needs F16 "
                                      f"[{size}] for the trellis {list(t.shape)}")
            if scaled is None and (signs is None or signs.dtype != "I16" or signs.shape != (size // 16,)):
                raise CheckpointError(f"tensor {prefix}.s{side}h: missing (nor a legacy {prefix}.s{side} I16 "
                                      f"[{size // 16}] sign bitfield)")
        marks = [c for c in exl3.MARKERS if f"{prefix}.{c}" in st]
        if len(marks) > 1:
            raise CheckpointError(f"tensor {prefix}: carries both codebook markers .mcg and .mul1")
        if K in exl3.HALF_RATES and marks != ["mul1"]:
            raise CheckpointError(f"tensor {prefix}.trellis: bitrate {K} needs the mul1 codebook (no .mul1 marker)")

    def _stored_name(self, name: str) -> str | None:
        """Which stored tensor serves the canonical `name` (through the gate.bias fallback), or None."""
        if name in self._stored:
            return name
        alt = self._alias.get(name)
        return alt if alt in self._stored else None

    def _quant(self, stored_name: str) -> str | None:
        """'fp8' / 'fp4' when the tensor is a block-quantized weight with a `.scale` companion."""
        t = self._stored[stored_name]
        if t.dtype in _FP8_TAGS or (t.dtype in _FP4_TAGS and stored_name.endswith(".weight")):
            scale = stored_name[: -len(".weight")] + ".scale"
            if scale not in self._stored:
                raise CheckpointError(f"tensor {stored_name}: stored as {t.dtype}, which needs a block-scale tensor "
                                      f"{scale}, and there is none")
            if self._stored[scale].dtype not in _SCALE_TAGS:
                raise CheckpointError(f"tensor {scale}: dtype {self._stored[scale].dtype}, a scale must be one of "
                                      f"{sorted(_SCALE_TAGS)}")
            return "fp8" if t.dtype in _FP8_TAGS else "fp4"
        return None

    def _part_shape(self, prefix: str) -> tuple[int, int]:
        """(out, in) of one EXL3 Linear or plain slice, in checkpoint orientation."""
        if f"{prefix}.trellis" in self._stored:
            t = self._stored[f"{prefix}.trellis"].shape
            return t[1] * exl3.TILE, t[0] * exl3.TILE
        return tuple(self._stored[f"{prefix}.weight"].shape)

    def _parts_shape(self, name: str) -> tuple[int, ...]:
        shapes = [self._part_shape(p) for p in self._parts[name]]
        if any(s[1] != shapes[0][1] for s in shapes):
            raise CheckpointError(f"tensor {name}: its slices have different widths {[s[1] for s in shapes]}")
        return sum(s[0] for s in shapes), shapes[0][1]

    def _logical_shape(self, stored_name: str) -> tuple[int, ...]:
        t = self._stored[stored_name]
        if self._quant(stored_name) == "fp4":
            return (*t.shape[:-1], t.shape[-1] * 2)
        return t.shape

    def _check_inventory(self) -> None:
        missing = [n for n in self._specs
                   if self._stored_name(n) is None and n not in self._parts and not self._tied_head(n)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"tensor {missing[0]}: required by the config (n_blocks={self.config.n_blocks}, "
                                  f"n_routed_experts={self.config.n_routed_experts}) but missing{more}")
        for name, spec in {**self._specs, **self._optional}.items():
            if name in self._parts:
                sn, shape = f"{self._parts[name][0]}.*", self._parts_shape(name)
            else:
                sn = self._stored_name(name)
                if sn is None:
                    continue
                dtype = self._stored[sn].dtype
                if dtype not in _FLOAT_TAGS and self._quant(sn) is None:
                    raise CheckpointError(f"tensor {sn}: dtype {dtype} is neither a float type nor FP8/FP4 with a "
                                          f"scale")
                shape = self._logical_shape(sn)
            if tuple(shape) != spec.shape:
                raise CheckpointError(f"tensor {sn}: shape {list(shape)}, expected {list(spec.shape)} from the config")

    def _tied_head(self, name: str) -> bool:
        return name == "head.weight" and self.config.tie_word_embeddings and "head.weight" not in self._stored

    @property
    def identity_digest(self) -> str:
        """The manifest's digest, or (no manifest) the same digest computed over the stored bytes."""
        if self._identity is None:
            recs = records_from_files(t for n, t in self._stored.items() if self._is_drafter(n))
            self._identity = compute_manifest(self.config.digest(), recs)["identity_digest"]
        return self._identity

    def files(self) -> list[str]:
        return sorted(self.spans())

    def spans(self) -> dict[str, tuple[int, int]]:
        """Each file's byte range that holds the drafter's tensors (a trunk's shard holds more)."""
        out: dict[str, tuple[int, int]] = {}
        for n, t in self._stored.items():
            if self._is_drafter(n):
                lo, hi = out.get(str(t.path), (t.begin, t.end))
                out[str(t.path)] = (min(lo, t.begin), max(hi, t.end))
        return out

    def names(self) -> list[str]:
        """Canonical names `read` serves: every required tensor and the optional ones present."""
        out = set(self._specs)
        out |= {n for n in self._optional if self._stored_name(n) is not None or self._tied_head(n)}
        return sorted(out)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._tied_head(name):
            return self._logical_shape("embed.weight")
        if name in self._parts:
            return self._parts_shape(name)
        sn = self._stored_name(name)
        if sn is None:
            raise KeyError(f"tensor {name}: not in the checkpoint")
        return tuple(self._logical_shape(sn))

    def storage(self, name: str) -> str:
        """How it is stored: "exl3", "slices" (plain wo_a), "fp8", "fp4", or a plain tensor's dtype tag."""
        if name in self._parts:
            return "exl3" if f"{self._parts[name][0]}.trellis" in self._stored else "slices"
        sn = "embed.weight" if self._tied_head(name) else self._stored_name(name)
        if sn is None:
            raise KeyError(f"tensor {name}: not in the checkpoint")
        return self._quant(sn) or self._stored[sn].dtype

    def _check_slice(self, name: str, shape, dim, start, stop) -> tuple[int | None, int | None]:
        if dim is None:
            if start is not None or stop is not None:
                raise ValueError(f"tensor {name}: start/stop given without dim")
            return None, None
        if not 0 <= dim < len(shape):
            raise ValueError(f"tensor {name}: dim {dim} out of range for shape {list(shape)}")
        start = 0 if start is None else start
        stop = shape[dim] if stop is None else stop
        if not 0 <= start < stop <= shape[dim]:
            raise ValueError(f"tensor {name}: slice [{start}, {stop}) of dim {dim} is not inside "
                             f"0..{shape[dim]} (need 0 <= start < stop <= size)")
        return start, stop

    def read(self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None,
             device: str | torch.device = "cpu", staging=None) -> torch.Tensor:
        """The tensor or its [start, stop) slice along `dim`, in compute form. A `staging.Staging` reads plain
        tensors and row cuts faster (the same bytes)."""
        kind = kind_of(name)
        if name in self._parts:
            start, stop = self._check_slice(name, self._parts_shape(name), dim, start, stop)
            return _to_compute(self._read_parts(name, dim, start, stop, device), kind, name, self.storage(name))
        sn = "embed.weight" if self._tied_head(name) else self._stored_name(name)
        if sn is None:
            raise KeyError(f"tensor {name}: not in the checkpoint")
        start, stop = self._check_slice(name, self._logical_shape(sn), dim, start, stop)
        quant = self._quant(sn)
        raw = self._staged(sn, dim, start, stop, staging) if staging is not None and quant is None else None
        if raw is None:
            raw = (self._read_raw(sn, dim, start, stop).to(device) if quant is None
                   else self._read_quant(sn, quant, dim, start, stop, device))
        return _to_compute(raw, kind, name, self._stored[sn].dtype)

    def exl3(self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None,
             device: str | torch.device = "cpu") -> list[exl3.Exl3Linear]:
        """The raw EXL3 records of `name` or its cut (128-multiples), one per stored Linear in row order, for kernels
        that multiply by the trellis; each `weight().T` is the matching block of `read`."""
        if self.storage(name) != "exl3":
            raise CheckpointError(f"tensor {name}: stored as {self.storage(name)}, not EXL3")
        start, stop = self._check_slice(name, self._parts_shape(name), dim, start, stop)
        return [self._exl3_part(p, dim, lo, hi).to(device) for p, lo, hi in self._cut_parts(name, dim, start, stop)]

    def close(self) -> None:
        """Drop the open file handles (their mmaps); later reads reopen them."""
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def _read_raw(self, sn: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        h = self._handle(self._stored[sn].path)
        if dim is None:
            return h.get_tensor(sn)
        return h.get_slice(sn)[(slice(None),) * dim + (slice(start, stop),)]

    def _staged(self, sn: str, dim, start, stop, staging) -> torch.Tensor | None:
        """`sn` or its rows (one contiguous byte range) through `staging`; None for what staging does not read."""
        t = self._stored[sn]
        dtype = _STAGED_DTYPES.get(t.dtype)
        if dtype is None or dim not in (None, 0) or not t.shape:
            return None
        shape = list(t.shape)
        row = math.prod(shape[1:]) * dtype.itemsize
        lo, hi = (0, shape[0]) if dim is None else (start, stop)
        shape[0] = hi - lo
        return staging.read(t.path, t.begin + lo * row, t.begin + hi * row).view(dtype).view(shape)

    def _cut_parts(self, name: str, dim, start, stop) -> list[tuple[str, int | None, int | None]]:
        """(prefix, start, stop) within each stored part the cut touches."""
        if dim != 0:
            return [(p, start, stop) for p in self._parts[name]]
        out, off = [], 0
        for p in self._parts[name]:
            rows = self._part_shape(p)[0]
            lo, hi = max(start, off), min(stop, off + rows)
            if lo < hi:
                out.append((p, lo - off, hi - off))
            off += rows
        return out

    def _read_parts(self, name: str, dim, start, stop, device) -> torch.Tensor:
        """fp16 (out, in): each part decoded over the 128-channel blocks the cut touches, then trimmed."""
        pieces = []
        for prefix, lo, hi in self._cut_parts(name, dim, start, stop):
            if f"{prefix}.trellis" not in self._stored:
                pieces.append(self._read_raw(f"{prefix}.weight", dim, lo, hi).to(device).to(torch.float16))
                continue
            wlo = None if dim is None else lo // exl3.HAD * exl3.HAD
            whi = None if dim is None else -(-hi // exl3.HAD) * exl3.HAD
            w = self._exl3_part(prefix, dim, wlo, whi).to(device).weight().T
            pieces.append(w.contiguous() if dim is None else w.narrow(dim, lo - wlo, hi - lo).contiguous())
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def _exl3_part(self, prefix: str, dim, start, stop) -> exl3.Exl3Linear:
        """One stored EXL3 Linear or its cut along `dim` (checkpoint orientation, transposed from EXL3's)."""
        if dim is not None and (start % exl3.HAD or stop % exl3.HAD):
            raise CheckpointError(f"tensor {prefix}: EXL3 cut [{start}, {stop}) of dim {dim} is not on "
                                  f"{exl3.HAD}-channel boundaries (the Hadamard block)")
        side = {None: None, 0: "v", 1: "u"}[dim]             # out features carry svh, in features suh
        t_dim = {None: None, 0: 1, 1: 0}[dim]
        trellis = self._read_raw(f"{prefix}.trellis", t_dim, None if dim is None else start // exl3.TILE,
                                 None if dim is None else stop // exl3.TILE)
        scales = {}
        for s in ("u", "v"):
            if f"{prefix}.s{s}h" in self._stored:
                cut = side == s
                scales[s] = self._read_raw(f"{prefix}.s{s}h", 0 if cut else None, start if cut else None,
                                           stop if cut else None)
            else:
                v = exl3.unpack_signs(self._read_raw(f"{prefix}.s{s}", None, None, None))
                scales[s] = v[start:stop] if side == s else v
        return exl3.Exl3Linear(trellis, scales["u"], scales["v"], self._codebook(prefix))

    def _codebook(self, prefix: str) -> str:
        """The codebook a marker names, its value checked (as exllamav3 does)."""
        if prefix not in self._codebooks:
            cb = "3inst"
            for name, value in exl3.MARKERS.items():
                if f"{prefix}.{name}" in self._stored:
                    got = int(self._read_raw(f"{prefix}.{name}", None, None, None).reshape(-1)[0]) & 0xFFFFFFFF
                    if got != value:
                        raise CheckpointError(f"tensor {prefix}.{name}: holds {got:#x}, the {name} codebook marker "
                                              f"is {value:#x}")
                    cb = name
            self._codebooks[prefix] = cb
        return self._codebooks[prefix]

    def _read_quant(self, sn: str, quant: str, dim, start, stop, device) -> torch.Tensor:
        """Dequantize only the scale blocks covering the slice, then trim."""
        scale_name = sn[: -len(".weight")] + ".scale"
        shape = self._logical_shape(sn)
        grid = self._stored[scale_name].shape
        if len(shape) != 2 or len(grid) != 2:
            raise CheckpointError(f"tensor {sn}: block-quantized tensors must be 2-D with a 2-D scale grid, got "
                                  f"{list(shape)} and {list(grid)}")
        block = (_block_len(shape[0], grid[0], sn), _block_len(shape[1], grid[1], sn))
        if quant == "fp4" and block[1] % 2:
            raise CheckpointError(f"tensor {sn}: FP4 scale blocks of {block[1]} columns split a packed byte")
        if dim is None:
            w, s = self._read_raw(sn, None, None, None), self._read_raw(scale_name, None, None, None)
            lo = 0
        else:
            b = block[dim]
            lo, hi = start // b * b, min(-(-stop // b) * b, shape[dim])      # widen to whole scale blocks
            packed = 2 if (quant == "fp4" and dim == len(shape) - 1) else 1
            w = self._read_raw(sn, dim, lo // packed, hi // packed)
            s = self._read_raw(scale_name, dim, lo // b, -(-hi // b))
        w, s = w.to(device), s.to(device)
        values = decode_fp4(w) if quant == "fp4" else w.to(torch.float32)
        out = _apply_scales(values, scale_values(s), block)
        return out if dim is None else out.narrow(dim, start - lo, stop - start)


def _to_compute(t: torch.Tensor, kind: str, name: str, stored: str) -> torch.Tensor:
    if not t.is_floating_point():
        raise CheckpointError(f"tensor {name}: stored as {stored}, not a float type")
    if kind in ("linear", "linear_bias"):
        want = torch.float16
    elif kind == "norm":
        want = t.dtype if t.dtype in (torch.bfloat16, torch.float16) else torch.float16
    elif kind == "fp32":
        want = torch.float32
    else:                                       # "table": embed / markov_w1 stay as stored
        want = t.dtype
    out = t.to(want)
    bad = ~torch.isfinite(out)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise CheckpointError(f"tensor {name}: element {i} is {t.flatten()[i].item()!r} (stored {stored}) and "
                              f"{out.flatten()[i].item()!r} as {str(want).removeprefix('torch.')}: weights must be "
                              f"finite in their compute dtype")
    return out
