"""EXL3, exllamav3's trellis format: a stored Linear decoded to fp16 in plain torch, bit for bit with exllamav3
1.6.5's CUDA kernels on any device (storage and rounding points: docs/exl3.md). Sources, in `exllamav3_ext/quant/`:
`pack.cu` (the bitstream), `exl3_dq.cuh` (a position's 16-bit state), `codebook.cuh` (state -> fp16),
`reconstruct.cu` (a tile's lane order; `reconstruct_had_tile`'s rounding points, which `reconstruct` follows).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

HAD = 128                       # Hadamard block, the unit of every cut
TILE = 16                       # a trellis tile is 16 x 16 weights
CODEBOOKS = ("3inst", "mcg", "mul1")
HALF_RATES = (1.5, 2.5, 3.5)    # mul1 only: positions alternate K - 0.5 and K + 0.5 bits, odd positions the wider
# exllamav3 quantize.py's codebook_mcg_mult / codebook_mul1_mult: it refuses any other stored value.
MARKERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}
# The kernels' 1/sqrt(128): `__float2half2_rn(0.08838834764831845f)`, an fp16 (1448 / 2**14), not the exact value.
R_SCALE = 0.08837890625


class Exl3Error(ValueError):
    """A malformed EXL3 tensor."""


def bits_of(words: int) -> int | float:
    """K from the tile width W (trellis.shape[-1]): an integer 1..8 for 16 K, a half rate for 16 K + 8."""
    if words % 16 == 0 and 1 <= words // 16 <= 8:
        return words // 16
    if words % 16 == 8 and words // 16 + 0.5 in HALF_RATES:
        return words // 16 + 0.5
    raise Exl3Error(f"trellis tile width {words}: not 16 K words for a bitrate K in 1..8 or {HALF_RATES}")


def tile_words(K: int | float) -> int:
    if K in HALF_RATES or (float(K).is_integer() and 1 <= K <= 8):
        return int(16 * K)
    raise Exl3Error(f"bitrate {K}: must be an integer 1..8 or one of {HALF_RATES} (mul1 codebook)")


@lru_cache
def _state_windows(words: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: the word holding its state's first bit, the next (cyclic: tail-biting) and the aligning shift.
    A position's state is the stream's 16 bits ending at its last bit."""
    K = bits_of(words)
    t = torch.arange(256, dtype=torch.int64)
    if isinstance(K, int):
        end = (t + 1) * K
    else:                       # alternating K - 0.5 / K + 0.5 bits (mask 0xAAAA: the odd positions are wider)
        end = (t + 1) * int(K) + (t + 1) // 2
    start = (end - 16) % (words * 16)
    w0 = start // 16
    return w0, (w0 + 1) % words, 16 - start % 16


def tile_states(trellis: torch.Tensor) -> torch.Tensor:
    w0, w1, shift = (x.to(trellis.device) for x in _state_windows(trellis.shape[-1]))
    words = trellis.to(torch.int64) & 0xFFFF
    # pack_trellis writes each pair of MSB-first stream words swapped (SWAP16 of a uint32): undo it.
    stream = words.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    window = (stream[..., w0] << 16) | stream[..., w1]
    return (window >> shift) & 0xFFFF


def _f16_bits(x: torch.Tensor) -> torch.Tensor:
    return ((x ^ 0x8000) - 0x8000).to(torch.int16).view(torch.float16)


@lru_cache
def codebook_table(codebook: str) -> torch.Tensor:
    """The fp16 value of each of the 65536 states (codebook.cuh `decode_3inst<cb>`), on the CPU."""
    x = torch.arange(65536, dtype=torch.int64)
    if codebook == "mul1":
        # The kernel's fp16 fma: h * k_inv + k_bias is exact in fp32, so one rounding to fp16 is the fma's.
        x = (x * MARKERS["mul1"]) & 0xFFFFFFFF
        h = 1024 + (x & 255) + ((x >> 8) & 255) + ((x >> 16) & 255) + (x >> 24)
        k_inv = _f16_bits(torch.tensor(0x1EEE)).float()
        k_bias = _f16_bits(torch.tensor(0xC931)).float()
        return (h.float() * k_inv + k_bias).half()
    if codebook == "3inst":
        x = (x * 89226354 + 64248484) & 0xFFFFFFFF
    elif codebook == "mcg":
        x = (x * MARKERS["mcg"]) & 0xFFFFFFFF
    else:
        raise Exl3Error(f"codebook {codebook!r}: must be one of {CODEBOOKS}")
    # Two fp16s added with __hadd: their fp32 sum is exact, so one rounding to fp16 is the fp16 add.
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return (_f16_bits(x & 0xFFFF).float() + _f16_bits(x >> 16).float()).half()


def codebook_rms(codebook: str) -> float:
    """RMS over all states (a uniformly random trellis draws them uniformly)."""
    return codebook_table(codebook).double().square().mean().sqrt().item()


@lru_cache
def tile_order() -> torch.Tensor:
    """Each trellis position's row-major index in its tile: a tensor-core B fragment's lanes (tensor_core_perm)."""
    order = []
    for lane in range(32):
        r0, c0 = (lane % 4) * 2, lane // 4
        for c in (c0, c0 + 8):
            order += [(r0 + dr) * 16 + c for dr in (0, 1, 8, 9)]
    return torch.tensor(order, dtype=torch.int64)


def inner_weight(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """The rotated-basis fp16 weight (in, out), as exllamav3_ext `reconstruct`."""
    rows, cols = trellis.shape[0], trellis.shape[1]
    vals = codebook_table(codebook).to(trellis.device)[tile_states(trellis)]
    tiles = vals[..., torch.argsort(tile_order()).to(trellis.device)]         # row-major 16 x 16 per tile
    return tiles.view(rows, cols, TILE, TILE).permute(0, 2, 1, 3).reshape(rows * TILE, cols * TILE)


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _butterfly(x: torch.Tensor, stride: int, to_f16: bool) -> torch.Tensor:
    v = x.unflatten(-1, (HAD // (2 * stride), 2, stride))
    a, b = v[..., 0, :], v[..., 1, :]
    out = torch.stack((a + b, a - b), dim=-2).flatten(-3)
    return _f16(out) if to_f16 else out


def _hadamard(x: torch.Tensor, first_stages_fp32: bool) -> torch.Tensor:
    """Hadamard / sqrt(128) along the last dim, rounded as reconstruct_had_tile: strides 1-2 in fp16 (first side) or
    fp32 (second side), R_SCALE, strides 4-64 in fp16; an fp16 op is its exact fp32 result rounded once."""
    for s in (1, 2):
        x = _butterfly(x, s, not first_stages_fp32)
    x = _f16(_f16(x) * R_SCALE)
    for s in (4, 8, 16, 32, 64):
        x = _butterfly(x, s, True)
    return x


def rotate(inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """diag(suh) . H . inner . H . diag(svh) in reconstruct_had_slice's order, each product rounded to fp16."""
    k, n = inner.shape
    x = inner.float().view(k // HAD, HAD, n).transpose(1, 2)
    x = _hadamard(x, first_stages_fp32=False).transpose(1, 2).reshape(k, n)
    x = _hadamard(x.view(k, n // HAD, HAD), first_stages_fp32=True).view(k, n)
    x = _f16(x * suh.float().unsqueeze(1))
    return (x * svh.float().unsqueeze(0)).to(torch.float16)


def reconstruct(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str,
                max_elements: int = 1 << 24) -> torch.Tensor:
    """The fp16 weight (in, out), decoded in slabs of `max_elements` to bound the temporaries."""
    k, n = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    if k % HAD or n % HAD:
        raise Exl3Error(f"trellis {list(trellis.shape)}: a ({k}, {n}) weight, both dims must be multiples of {HAD}")
    if tuple(suh.shape) != (k,) or tuple(svh.shape) != (n,):
        raise Exl3Error(f"trellis {list(trellis.shape)} needs suh ({k}) and svh ({n}), got {list(suh.shape)} and "
                        f"{list(svh.shape)}")
    step = max(1, max_elements // (k * HAD)) * HAD
    out = torch.empty((k, n), dtype=torch.float16, device=trellis.device)
    for c in range(0, n, step):
        e = min(n, c + step)
        out[:, c:e] = rotate(inner_weight(trellis[:, c // TILE: e // TILE], codebook), suh, svh[c:e])
    return out


def unpack_signs(bitfield: torch.Tensor) -> torch.Tensor:
    """Legacy `.su` / `.sv` int16 bitfields (LSB first; a set bit is -1) as fp16 signs."""
    bits = (bitfield.to(torch.int64).unsqueeze(-1) >> torch.arange(16, device=bitfield.device)) & 1
    return (1 - 2 * bits.flatten()).to(torch.float16)


@dataclass(frozen=True)
class Exl3Linear:
    """One EXL3 Linear as stored, in EXL3 orientation: dim 0 in features, dim 1 out features."""
    trellis: torch.Tensor           # int16 (in/16, out/16, W)
    suh: torch.Tensor               # fp16 (in,)
    svh: torch.Tensor               # fp16 (out,)
    codebook: str

    @property
    def K(self) -> int | float:
        return bits_of(self.trellis.shape[-1])

    @property
    def in_features(self) -> int:
        return self.trellis.shape[0] * TILE

    @property
    def out_features(self) -> int:
        return self.trellis.shape[1] * TILE

    def weight(self) -> torch.Tensor:
        """fp16 (in, out), exllamav3's reconstruct_had_slice bit for bit."""
        return reconstruct(self.trellis, self.suh, self.svh, self.codebook)

    def narrow(self, dim: int, start: int, stop: int) -> "Exl3Linear":
        """Features [start, stop) of `dim`: at 128-multiples the shard decodes to the same slice of `weight()`."""
        size = self.trellis.shape[dim] * TILE
        if start % HAD or stop % HAD or not 0 <= start < stop <= size:
            raise Exl3Error(f"cut [{start}, {stop}) of dim {dim} (size {size}): EXL3 cuts need 0 <= start < stop <= "
                            f"size at multiples of {HAD} (the Hadamard block)")
        t = self.trellis.narrow(dim, start // TILE, (stop - start) // TILE)
        if dim == 0:
            return Exl3Linear(t, self.suh[start:stop], self.svh, self.codebook)
        return Exl3Linear(t, self.suh, self.svh[start:stop], self.codebook)

    def to(self, device) -> "Exl3Linear":
        return Exl3Linear(self.trellis.to(device), self.suh.to(device), self.svh.to(device), self.codebook)
