"""Read a checkpoint in the DeepSeek-V4 drafter namespace, synthetic or real, into the drafter's compute form.

    ckpt = Checkpoint(dir)                      # config, tensor discovery, manifest and inventory checks
    ckpt.read("mtp.0.attn.wq_b.weight", dim=0, start=0, stop=16384, device="cuda:0")   # one rank's rows only

Compute form (inventory.COMPUTE_RULES): Linear weights and biases fp16, whatever the storage (bf16/fp32 rounded to
nearest; DeepSeek's FP8 E4M3 block-scaled and FP4 e2m1 routed experts dequantized); `embed.weight` and
`markov_w1` as stored; norm weights bf16/fp16 as stored, fp32 -> fp16; hc_*, attn_sink and gate.bias fp32.
A slice read touches only the requested rows/columns on disk (plus the rest of their scale blocks for FP8/FP4)
and equals the same slice of a full read, so a rank never loads the half it does not own.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import DrafterConfig, load_config
from .inventory import fallback_names, kind_of, optional_specs, tensor_specs
from .manifest import (MANIFEST_NAME, ManifestError, StoredTensor, check_content, check_layout, compute_manifest,
                       read_manifest, records_from_files, scan_safetensors)


class CheckpointError(ValueError):
    """The checkpoint cannot serve the config; the message names the tensor, what it has and what is required."""


_FLOAT_TAGS = {"F16", "BF16", "F32", "F64"}
_FP8_TAGS = {"F8_E4M3"}
_FP4_TAGS = {"I8", "U8"}                    # two e2m1 codes per byte
_SCALE_TAGS = {"F8_E8M0", "U8", "F32", "BF16", "F16"}
# e2m1 magnitudes for codes 0..7; bit 3 of a code is the sign (spec section 2).
_FP4_LUT = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ==== dequantization (DeepSeek's original storage) ==================================================================
def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 block scales. E8M0 (or raw exponent bytes as U8): 2**(b-127), built as the fp32 bit pattern with
    exponent field b (exact; b = 0 is the subnormal 2**-127, b = 255 is E8M0's NaN). Float scales pass through."""
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
    """values (fp32, rows x cols) times each block's scale; exact in fp32 (a power of two), then one fp16 rounding."""
    s = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (values * s[: values.shape[0], : values.shape[1]]).to(torch.float16)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 E4M3 (R, C) with a (gr, gc) scale grid -> fp16 (R, C)."""
    block = (_block_len(weight.shape[0], scale.shape[0]), _block_len(weight.shape[1], scale.shape[1]))
    return _apply_scales(weight.to(torch.float32), scale_values(scale), block)


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 e2m1 packed (R, C/2) with a (gr, gc) scale grid (blocks [1, 32] in DeepSeek's experts) -> fp16 (R, C)."""
    values = decode_fp4(packed)
    block = (_block_len(values.shape[0], scale.shape[0]), _block_len(values.shape[1], scale.shape[1]))
    return _apply_scales(values, scale_values(scale), block)


def _block_len(n: int, groups: int, what: str = "weight") -> int:
    """Block length along one axis from the scale grid: n / groups when it divides, else the power of two that
    gives `groups` blocks with a short last one (DeepSeek's blocks are 128 or 32 and shapes may not divide)."""
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


# ==== the checkpoint ================================================================================================
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
        self._alias = fallback_names(cfg)                      # canonical -> alternative stored name
        self._handles: dict[Path, object] = {}
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

    # ---- discovery ---------------------------------------------------------------------------------------------
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
        """True for the tensors the drafter reads (real checkpoints also hold the trunk's, which we ignore)."""
        if name.endswith(".scale"):
            name = name[: -len(".scale")] + ".weight"
        return name in self._specs or name in self._optional or name in self._alias.values()

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

    def _logical_shape(self, stored_name: str) -> tuple[int, ...]:
        t = self._stored[stored_name]
        if self._quant(stored_name) == "fp4":
            return (*t.shape[:-1], t.shape[-1] * 2)
        return t.shape

    def _check_inventory(self) -> None:
        missing = [n for n in self._specs if self._stored_name(n) is None and not self._tied_head(n)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"tensor {missing[0]}: required by the config (n_blocks={self.config.n_blocks}, "
                                  f"n_routed_experts={self.config.n_routed_experts}) but missing{more}")
        for name, spec in {**self._specs, **self._optional}.items():
            sn = self._stored_name(name)
            if sn is None:
                continue
            dtype = self._stored[sn].dtype
            if dtype not in _FLOAT_TAGS and self._quant(sn) is None:
                raise CheckpointError(f"tensor {sn}: dtype {dtype} is neither a float type nor FP8/FP4 with a scale")
            shape = self._logical_shape(sn)
            if tuple(shape) != spec.shape:
                raise CheckpointError(f"tensor {sn}: shape {list(shape)}, expected {list(spec.shape)} from the config")

    def _tied_head(self, name: str) -> bool:
        return name == "head.weight" and self.config.tie_word_embeddings and "head.weight" not in self._stored

    # ---- public API --------------------------------------------------------------------------------------------
    @property
    def identity_digest(self) -> str:
        """The manifest's digest, or (no manifest) the same digest computed over the drafter's stored bytes."""
        if self._identity is None:
            recs = records_from_files(t for n, t in self._stored.items() if self._is_drafter(n))
            self._identity = compute_manifest(self.config.digest(), recs)["identity_digest"]
        return self._identity

    def names(self) -> list[str]:
        """Canonical names `read` serves: every required tensor (head.weight when tied and absent, gate.bias through
        its fallback) and the optional ones present."""
        out = set(self._specs)
        out |= {n for n in self._optional if self._stored_name(n) is not None or self._tied_head(n)}
        return sorted(out)

    def shape(self, name: str) -> tuple[int, ...]:
        if self._tied_head(name):
            return self._logical_shape("embed.weight")
        sn = self._stored_name(name)
        if sn is None:
            raise KeyError(f"tensor {name}: not in the checkpoint")
        return tuple(self._logical_shape(sn))

    def read(self, name: str, dim: int | None = None, start: int | None = None, stop: int | None = None,
             device: str | torch.device = "cpu") -> torch.Tensor:
        """The tensor (or its [start, stop) slice along `dim`) in compute form, on `device`."""
        kind = kind_of(name)
        sn = "embed.weight" if self._tied_head(name) else self._stored_name(name)
        if sn is None:
            raise KeyError(f"tensor {name}: not in the checkpoint")
        shape = self._logical_shape(sn)
        if dim is None:
            if start is not None or stop is not None:
                raise ValueError(f"tensor {name}: start/stop given without dim")
        else:
            if not 0 <= dim < len(shape):
                raise ValueError(f"tensor {name}: dim {dim} out of range for shape {list(shape)}")
            start = 0 if start is None else start
            stop = shape[dim] if stop is None else stop
            if not 0 <= start < stop <= shape[dim]:
                raise ValueError(f"tensor {name}: slice [{start}, {stop}) of dim {dim} is not inside "
                                 f"0..{shape[dim]} (need 0 <= start < stop <= size)")
        quant = self._quant(sn)
        if quant is None:
            raw = self._read_raw(sn, dim, start, stop).to(device)
        else:
            raw = self._read_quant(sn, quant, dim, start, stop, device)
        return _to_compute(raw, kind, name, self._stored[sn].dtype)

    def close(self) -> None:
        """Drop the open file handles (their mmaps); reads after this reopen them."""
        self._handles.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- reading -----------------------------------------------------------------------------------------------
    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def _read_raw(self, sn: str, dim: int | None, start: int | None, stop: int | None) -> torch.Tensor:
        h = self._handle(self._stored[sn].path)
        if dim is None:
            return h.get_tensor(sn)
        return h.get_slice(sn)[(slice(None),) * dim + (slice(start, stop),)]

    def _read_quant(self, sn: str, quant: str, dim, start, stop, device) -> torch.Tensor:
        """Dequantize only the scale blocks that cover the slice, then trim to it."""
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
