"""EXL3 (exllamav3's trellis format): the torch decode against literal ports of exllamav3 1.6.5's CUDA code, the
tiny EXL3 checkpoint through the loader (every stored form, every rank's cut), and the drafter end to end on it.

The ports below follow `exllamav3_ext/quant/{codebook.cuh, exl3_dq.cuh, pack.cu, reconstruct.cu}` statement by
statement in plain Python / numpy scalars, a second derivation beside `dspark_ray/weights/exl3.py`'s vectorized one;
the GPU machine checks the decode against the kernels themselves (`tools/exl3_device_check.py`).
"""
from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspark_ray.testing import parity, workload
from dspark_ray.actors.placement import teardown
from dspark_ray.client import DrafterClient
from dspark_ray.config import tiny
from dspark_ray.rank.engine import RankEngine
from dspark_ray.testing.batches import Driver
from dspark_ray.model.layout import Layout
from dspark_ray.rank.modes import make_drafter, make_emulated, read_rank, run_pair
from dspark_ray.weights import exl3
from dspark_ray.weights.loader import Checkpoint, CheckpointError, canonical_name
from dspark_ray.weights.manifest import MANIFEST_NAME, ManifestError, read_manifest, scan_safetensors
from dspark_ray.weights.mix import MixError, parse_mix
from dspark_ray.weights.synth import save_tensors, synthesize
from dspark_ray.weights.synth_command import synth_main

from conftest import deploy_pair, step_as_reference, flip_stored_byte

ST = "model.safetensors"
# Every stored kind at once: the three codebooks, integer and half rates, 1 to 8 bits, EXL3 wo_a slices, plain.
KINDS_MIX = "head=6:3inst,experts=1mcg,wo_a=3mcg,wq_b=5,wkv=2.5mul1,shared=1.5mul1,wo_b=8:3inst,wq_a=16,rest=7mcg"


# ==== literal ports of the CUDA code =================================================================================
def _f16(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]


def _round16(x: float) -> float:
    return struct.unpack("<e", struct.pack("<e", x))[0]     # round to nearest even (PyFloat_Pack2)


def decode_3inst(x: int, cb: int) -> float:
    """codebook.cuh decode_3inst<cb>, one state, Python ints and doubles (an fp16 sum is exact in a double)."""
    if cb == 0:
        x = (x * 89226354 + 64248484) & 0xFFFFFFFF
    elif cb == 1:
        x = (x * 0xCBAC1FED) & 0xFFFFFFFF
    else:
        x = (x * 0x83DCD12D) & 0xFFFFFFFF
        s = 0x6400 + sum((x >> (8 * i)) & 255 for i in range(4))      # __dp4a(x, 0x01010101, 0x6400)
        return _round16(_f16(s) * _f16(0x1EEE) + _f16(0xC931))       # __hfma: one rounding of the exact value
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60                                # lop3 0x6a
    return _round16(_f16(x) + _f16(x >> 16))                         # __hadd


def _u32(words: list[int]) -> list[int]:
    """The kernels' uint32 view of a tile's int16 words (little endian)."""
    w = [x & 0xFFFF for x in words]
    return [w[2 * i] | (w[2 * i + 1] << 16) for i in range(len(w) // 2)]


def _fshift(b: int, a: int, shift: int) -> int:
    return (((a << 32) | b) >> shift) & 0xFFFFFFFF


def dq_state(ptr: list[int], t: int, bits: int) -> int:
    """exl3_dq.cuh dq<bits>: position t's 16-bit state."""
    b0 = t * bits + bits - 16 + 256 * bits
    b1 = b0 + 16
    i0, i1 = b0 // 32, (b1 - 1) // 32
    s0 = (i1 + 1) * 32 - b1
    n = bits * 256 // 32
    return _fshift(ptr[i1 % n], ptr[i0 % n], s0) & 0xFFFF


def dq8_half_states(ptr: list[int], t_offset: int, KA: int) -> list[int]:
    """exl3_dq.cuh dq8_half<KA>: the states of positions t_offset .. t_offset + 7 at bitrate KA + 0.5."""
    bits2 = 2 * KA + 1
    words, gspan = 4 * bits2, 18 + 3 * KA
    e7 = ((t_offset >> 1) + 4) * bits2 + 128 * bits2
    out = []
    for e in (e7 - 2 * bits2, e7):
        hi, lo = (e - 1) // 32, (e - gspan) // 32
        w3 = _fshift(ptr[hi % words], ptr[lo % words], (hi + 1) * 32 - e)
        w2 = w3 >> (KA + 1)
        w1 = w2 >> KA
        w0 = w1 >> (KA + 1)
        out += [w0 & 0xFFFF, w1 & 0xFFFF, w2 & 0xFFFF, w3 & 0xFFFF]
    return out


def pack_tile(states: list[int], K: int) -> list[int]:
    """pack.cu pack_trellis_kernel<K>: 256 states -> the 16 K stored words (16 spans of 16 weights, then SWAP16)."""
    packed = [0] * (16 * K)
    for t in range(16):
        i, j, k, buf = 16 * t, K * t, 32, 0
        for _ in range(16):
            k -= K
            buf |= (states[i] & ((1 << K) - 1)) << k
            if k <= 16:
                packed[j] = (buf >> 16) & 0xFFFF
                buf = (buf << 16) & 0xFFFFFFFF
                k += 16
                j += 1
            i += 1
    return [w for m in range(8 * K) for w in (packed[2 * m + 1], packed[2 * m])]


def kernel_tile(values: list) -> list[list]:
    """reconstruct_tile's store of one warp's tile: lane l holds positions 8 l .. 8 l + 7 as frag[0] = (d0 d1, d2 d3),
    frag[1] = (d4 d5, d6 d7); the lanes without bit 2 pair theirs with lane l + 4's (__shfl_down_sync 4) into
    tile[r][c] half2s, columns 2c and 2c + 1."""
    tile = [[None] * 16 for _ in range(16)]
    for lane in range(32):
        if lane & 4:
            continue
        d, n = values[8 * lane: 8 * lane + 8], values[8 * (lane + 4): 8 * (lane + 4) + 8]
        r0, c0 = (lane % 4) * 2, lane // 8
        for j, (r, c) in enumerate([(r0, c0), (r0 + 1, c0), (r0 + 8, c0), (r0 + 9, c0),
                                    (r0, c0 + 4), (r0 + 1, c0 + 4), (r0 + 8, c0 + 4), (r0 + 9, c0 + 4)]):
            tile[r][2 * c], tile[r][2 * c + 1] = d[j], n[j]
    return tile


def _shuffle_had(regs: list) -> list:
    """shuffle_had_h2x32 on one register of every lane: 5 rounds of v = (lane & i ? -v : v) + v[lane ^ i] in fp16."""
    for i in (1, 2, 4, 8, 16):
        regs = [(-regs[lane] if lane & i else regs[lane]) + regs[lane ^ i] for lane in range(32)]
    return regs


def kernel_rotate_block(inner: np.ndarray, suh: np.ndarray, svh: np.ndarray) -> np.ndarray:
    """reconstruct_had_tile on one 128 x 128 block (fp16 numpy): the column phase (each lane rows 4 l + i of a
    4-column chunk, fp16 butterfly, * rs2, lane shuffles), then the row phase (each lane columns 4 l .. 4 l + 3 of a
    row, fp32 butterfly rounded to fp16, * rs2, lane shuffles), then * suh[row] * svh[col]."""
    rs = np.float16(np.float32(0.08838834764831845))
    st = inner.astype(np.float16).copy()
    for q in range(32):
        cols = slice(4 * q, 4 * q + 4)
        regs = []
        for lane in range(32):
            v = [st[4 * lane + i, cols] for i in range(4)]
            s0, d0, s1, d1 = v[0] + v[1], v[0] - v[1], v[2] + v[3], v[2] - v[3]
            regs.append([(s0 + s1) * rs, (d0 + d1) * rs, (s0 - s1) * rs, (d0 - d1) * rs])
        for i in range(4):
            col = _shuffle_had([regs[lane][i] for lane in range(32)])
            for lane in range(32):
                st[4 * lane + i, cols] = col[lane]
    out = np.empty_like(st)
    for r in range(128):
        h01, h23 = [], []
        for lane in range(32):
            v0, v1, v2, v3 = (np.float32(x) for x in st[r, 4 * lane: 4 * lane + 4])
            s0, d0, s1, d1 = v0 + v1, v0 - v1, v2 + v3, v2 - v3
            h01.append(np.array([s0 + s1, d0 + d1], dtype=np.float32).astype(np.float16) * rs)
            h23.append(np.array([s0 - s1, d0 - d1], dtype=np.float32).astype(np.float16) * rs)
        h01, h23 = _shuffle_had(h01), _shuffle_had(h23)
        for lane in range(32):
            c = 4 * lane
            out[r, c: c + 2] = (h01[lane] * suh[r]) * svh[c: c + 2]
            out[r, c + 2: c + 4] = (h23[lane] * suh[r]) * svh[c + 2: c + 4]
    return out


# ==== the decode ====================================================================================================
def _words(shape, seed=0) -> torch.Tensor:
    return torch.randint(-32768, 32768, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(seed)
                         ).to(torch.int16)


def test_codebook_tables_equal_the_kernels_decode_state_by_state():
    for cb, name in enumerate(exl3.CODEBOOKS):
        want = torch.tensor([decode_3inst(s, cb) for s in range(65536)], dtype=torch.float16)
        assert torch.equal(exl3.codebook_table(name).view(torch.int16), want.view(torch.int16)), name
    # 3INST's spread is exllamav3's codebook_scale (quantize.py: 1.24371088); mul1 is near unit RMS.
    assert abs(exl3.codebook_rms("3inst") - 1.24371088) < 1e-4 and abs(exl3.codebook_rms("mul1") - 1) < 1e-3


EXL3_SRC = Path(os.environ.get("EXL3_SRC", "/tmp/exl3src/exllamav3"))


@pytest.mark.skipif(not (EXL3_SRC / "modules/quant/exl3_lib/ngram_codec.py").exists(),
                    reason="exllamav3's Python source not unpacked (EXL3_SRC)")
def test_mul1_table_equals_exllamav3s_own_torch_reference():
    # ngram_codec.py imports only torch, so it loads without exllamav3's CUDA extension.
    spec = importlib.util.spec_from_file_location("ngram_codec", EXL3_SRC / "modules/quant/exl3_lib/ngram_codec.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert torch.equal(mod.mul1_codebook("cpu").view(torch.int16), exl3.codebook_table("mul1").view(torch.int16))


@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 6, 7, 8, 1.5, 2.5, 3.5])
def test_tile_states_equal_the_kernels_bit_reader(K):
    words = _words((3, exl3.tile_words(K)), seed=int(K * 2))
    got = exl3.tile_states(words)
    for tile in range(3):
        ptr = _u32(words[tile].tolist())
        if isinstance(K, int):
            want = [dq_state(ptr, t, K) for t in range(256)]
        else:
            want = [s for t in range(0, 256, 8) for s in dq8_half_states(ptr, t, int(K))]
        assert got[tile].tolist() == want


@pytest.mark.parametrize("K", range(1, 9))
def test_states_pack_back_to_their_words_through_the_kernels_packer(K):
    # Any stored bitstream is a trellis: its states' low K bits, packed by pack_trellis, give back the same words.
    words = _words((2, 16 * K), seed=K)
    for tile in range(2):
        assert pack_tile(exl3.tile_states(words)[tile].tolist(), K) == [w & 0xFFFF for w in words[tile].tolist()]


def test_tile_order_is_the_reconstruct_kernels_lane_shuffle():
    tile = kernel_tile(list(range(256)))
    where = {p: r * 16 + c for r in range(16) for c, p in enumerate(tile[r])}
    assert exl3.tile_order().tolist() == [where[p] for p in range(256)]
    # inner_weight places position p of tile (i, j) at row 16 i + r, column 16 j + c.
    trellis = _words((2, 3, 64))
    w = exl3.inner_weight(trellis, "mcg")
    vals = exl3.codebook_table("mcg")[exl3.tile_states(trellis[1, 2])]
    for p in (0, 7, 8, 100, 255):
        r, c = divmod(where[p], 16)
        assert w[16 + r, 32 + c].view(torch.int16) == vals[p].view(torch.int16)


def _random_linear(k, n, K, cb, seed=0) -> exl3.Exl3Linear:
    g = torch.Generator().manual_seed(seed)
    suh = (torch.rand(k, generator=g) + 0.5) * torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    svh = (torch.rand(n, generator=g) * 0.1 + 0.01) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return exl3.Exl3Linear(_words((k // 16, n // 16, exl3.tile_words(K)), seed), suh.half(), svh.half(), cb)


def test_rotate_equals_the_fused_reconstruct_kernel_lane_by_lane():
    lin = _random_linear(128, 128, 4, "mul1", seed=3)
    inner = exl3.inner_weight(lin.trellis, lin.codebook)
    want = kernel_rotate_block(inner.numpy(), lin.suh.numpy(), lin.svh.numpy())
    got = exl3.rotate(inner, lin.suh, lin.svh)
    assert torch.equal(got.view(torch.int16), torch.from_numpy(want).view(torch.int16))


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def test_reconstruct_is_diag_suh_H_inner_H_diag_svh():
    lin = _random_linear(256, 384, 3, "3inst", seed=1)
    inner = exl3.inner_weight(lin.trellis, lin.codebook).double()
    hk, hn = torch.block_diag(*[_sylvester(128)] * 2), torch.block_diag(*[_sylvester(128)] * 3)
    exact = lin.suh.double()[:, None] * (hk @ inner @ hn) * lin.svh.double()[None, :]
    got = lin.weight().double()
    # fp16 steps plus the kernels' fp16 1/sqrt(128) (1.1e-4 low per side): well under 1% of the weights' scale.
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 5e-3


def test_a_cut_at_128_channels_decodes_to_the_full_decodes_slice_and_others_are_refused():
    lin = _random_linear(256, 384, 2, "mcg")
    full = lin.weight()
    for dim, size in ((0, 256), (1, 384)):
        for a in range(0, size, 128):
            for b in range(a + 128, size + 1, 128):
                assert torch.equal(lin.narrow(dim, a, b).weight(), full.narrow(dim, a, b - a)), (dim, a, b)
    with pytest.raises(exl3.Exl3Error, match=r"cut \[64, 256\) of dim 1 .*multiples of 128"):
        lin.narrow(1, 64, 256)
    with pytest.raises(exl3.Exl3Error, match="tile width 72: not 16 K words"):
        exl3.bits_of(72)          # 16 * 4.5: not a rate
    assert exl3.bits_of(40) == 2.5 and exl3.bits_of(56) == 3.5 and exl3.bits_of(128) == 8


def test_legacy_sign_bitfields_unpack_lsb_first():
    signs = exl3.unpack_signs(torch.tensor([0b101, -32768], dtype=torch.int16))
    assert signs[:4].tolist() == [-1, 1, -1, 1] and signs[16:].tolist() == [1] * 15 + [-1]


# ==== the bits mix ===================================================================================================
def test_bits_mix_parses_the_default_and_refuses_bad_entries():
    mix = parse_mix()
    assert (str(mix["head"]), str(mix["experts"]), str(mix["wo_a"]), str(mix["rest"])) == \
        ("6mul1", "2mul1", "fp8", "4mul1")
    assert str(parse_mix("rest=2.5,codebook=mul1")["rest"]) == "2.5mul1"
    for spec, words in [("head=9", "integer 1..8"), ("rest=2.5mcg", "mul1 codebook only"),
                        ("codebook=2inst", "codebook=2inst"), ("router=4", "unknown group 'router'"),
                        ("head=4,head=5", "given twice"), ("head", "group=value"), ("wq_a=four", "not 16, fp8")]:
        with pytest.raises(MixError, match=words):
            parse_mix(spec)
    with pytest.raises(SystemExit):
        synth_main(["--preset", "tiny", "--out", "/nonexistent/x", "--format", "exl3", "--bits", "head=9"])
    with pytest.raises(SystemExit):
        synth_main(["--preset", "tiny", "--out", "/nonexistent/x", "--bits", "head=6"])    # --bits needs exl3


# ==== the tiny EXL3 checkpoints ======================================================================================
@pytest.fixture(scope="module")
def exl3_dir(tmp_path_factory):
    """Seed 000's mix (the synth default): head 6 bpw, routed experts 2 bpw, FP8 wo_a, the rest 4 bpw, mul1."""
    out = tmp_path_factory.mktemp("exl3_ckpt")
    assert synth_main(["--preset", "tiny", "--out", str(out), "--format", "exl3", "--device", "cpu"]) == 0
    return out


@pytest.fixture(scope="module")
def kinds_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("exl3_kinds")
    synthesize(tiny(), out, fmt="exl3", bits=KINDS_MIX)
    return out


def _stored(d: Path) -> dict:
    return {t.name: t for f in sorted(d.glob("*.safetensors")) for t in scan_safetensors(f)}


def test_synth_exl3_is_deterministic_by_seed(exl3_dir, tmp_path):
    assert synth_main(["--preset", "tiny", "--out", str(tmp_path / "again"), "--format", "exl3"]) == 0
    for f in ("config.json", ST, MANIFEST_NAME):
        assert (exl3_dir / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f
    other = synthesize(tiny(), tmp_path / "seed1", seed=1, fmt="exl3")
    assert other["identity_digest"] != read_manifest(exl3_dir)["identity_digest"]
    assert other["config_digest"] == read_manifest(exl3_dir)["config_digest"] == tiny().digest()


def test_the_exl3_checkpoint_stores_the_mix_under_exllamav3s_names(exl3_dir, kinds_dir):
    st = _stored(exl3_dir)
    assert (st["head.trellis"].dtype, st["head.trellis"].shape) == ("I16", (16, 256, 96))
    assert (st["head.suh"].shape, st["head.svh"].shape, st["head.mul1"].shape) == ((256,), (4096,), ())
    assert st["mtp.1.ffn.experts.7.w2.trellis"].shape == (16, 16, 32)
    assert st["mtp.0.main_proj.trellis"].shape == (48, 16, 64) and st["mtp.2.attn.wq_b.trellis"].shape == (8, 64, 64)
    assert (st["mtp.0.attn.wo_a.weight"].dtype, st["mtp.0.attn.wo_a.scale"].dtype) == ("F8_E4M3", "F8_E8M0")
    assert st["mtp.0.attn.wo_a.scale"].shape == (4, 2)
    for plain in ("mtp.0.ffn.gate.weight", "mtp.2.markov_head.markov_w2.weight", "embed.weight",
                  "mtp.2.confidence_head.proj.weight", "mtp.1.attn.q_norm.weight"):
        assert st[plain].dtype in ("F16", "BF16", "F32"), plain
    assert not any(n.endswith(".weight") and n[: -len(".weight")] + ".trellis" in st for n in st)
    q = json.loads((exl3_dir / "config.json").read_text())["quantization_config"]
    assert q == {"quant_method": "exl3", "version": "1.6.5", "bits": 4, "head_bits": 6, "mtp_bits": 4,
                 "codebook": "mul1"}
    with open(exl3_dir / "config.json") as f:
        assert json.load(f)["architectures"] == ["DeepseekV4ForCausalLM"]
    k = _stored(kinds_dir)
    for g in range(4):
        assert k[f"mtp.1.attn.wo_a.slice.{g}.trellis"].shape == (16, 8, 48) and f"mtp.1.attn.wo_a.slice.{g}.mcg" in k
    assert "mtp.1.attn.wo_a.weight" not in k
    assert k["mtp.0.attn.wkv.trellis"].shape == (16, 8, 40) and "mtp.0.attn.wkv.mul1" in k
    assert k["mtp.0.ffn.shared_experts.w1.trellis"].shape[2] == 24 and k["head.trellis"].shape[2] == 96
    assert "head.mcg" not in k and "head.mul1" not in k                     # 3INST: no marker
    assert k["mtp.0.attn.wq_a.weight"].dtype == "F16" and k["mtp.0.ffn.experts.0.w1.trellis"].shape[2] == 16


def test_stored_names_map_to_the_namespace():
    assert canonical_name("mtp.0.attn.wo_a.slice.3.trellis") == "mtp.0.attn.wo_a.weight"
    assert canonical_name("mtp.0.attn.wo_a.slice.3.weight") == "mtp.0.attn.wo_a.weight"
    assert canonical_name("head.mul1") == canonical_name("head.svh") == "head.weight"
    assert canonical_name("mtp.0.attn.wo_a.scale") == "mtp.0.attn.wo_a.weight"
    assert canonical_name("mtp.1.attn.attn_sink") == "mtp.1.attn.attn_sink"


@pytest.mark.parametrize("which", ["exl3_dir", "kinds_dir"])
def test_every_exl3_tensor_reads_as_the_decode_of_its_stored_parts(which, request):
    d = request.getfixturevalue(which)
    c, raw = Checkpoint(d, verify_content=True), load_file(str(d / ST))
    seen = 0
    for name in c.names():
        if c.storage(name) != "exl3":
            continue
        key = name[: -len(".weight")]
        prefixes = [key] if f"{key}.trellis" in raw else [f"{key}.slice.{g}" for g in range(c.config.o_groups)]
        parts = []
        for p in prefixes:
            cb = next((m for m in exl3.MARKERS if f"{p}.{m}" in raw), "3inst")
            parts.append(exl3.reconstruct(raw[f"{p}.trellis"], raw[f"{p}.suh"], raw[f"{p}.svh"], cb).T)
        w = c.read(name)
        assert w.dtype == torch.float16 and tuple(w.shape) == c.shape(name) and torch.equal(w, torch.cat(parts)), name
        recs = c.exl3(name)
        assert torch.equal(torch.cat([r.weight().T for r in recs]), w) and len(recs) == len(prefixes)
        seen += 1
    # head, main_proj, and per block wq_a, wq_b, wkv, wo_a, wo_b, the routed and shared experts' w1 / w2 / w3, less
    # one per block: FP8 wo_a in seed 000's mix, plain wq_a in the kinds mix
    NB, E = c.config.n_blocks, c.config.n_routed_experts
    assert seen == 2 + NB * (5 + 3 * (E + 1)) - NB


@pytest.mark.parametrize("which", ["exl3_dir", "kinds_dir"])
def test_every_ranks_cut_of_every_exl3_tensor_decodes_to_the_full_tensors_slice(which, request):
    """The TP cut holds for EXL3: each cut falls on a 128-channel Hadamard boundary, and a rank reads only its trellis
    tiles and suh / svh entries, which decode to exactly the full tensor's rows / columns."""
    c = Checkpoint(request.getfixturevalue(which))
    lay = Layout(c.config, 2)
    ranks = [read_rank(c, lay, r) for r in (0, 1)]
    cut = 0
    for name in c.names():
        full = c.read(name)
        s0 = lay.slice_of(name, tuple(full.shape), 0)
        if s0 is None:
            assert torch.equal(ranks[0][name], full) and torch.equal(ranks[1][name], full), name
            continue
        for r in (0, 1):
            dim, a, b = lay.slice_of(name, tuple(full.shape), r)
            assert torch.equal(ranks[r][name], full.narrow(dim, a, b - a)), (name, r)
            if c.storage(name) == "exl3":
                assert a % 128 == 0 and b % 128 == 0, name
                recs = c.exl3(name, dim, a, b)
                # exllamav3's own tensor split: out features cut trellis columns + svh, in features rows + suh
                side = "svh" if dim == 0 else "suh"
                assert all(getattr(x, side).numel() == (b - a if len(recs) == 1 else c.config.o_lora_rank)
                           for x in recs), name
                assert torch.equal(torch.cat([x.weight().T for x in recs]), ranks[r][name]), (name, r)
                cut += 1
    assert cut >= 2 * c.config.n_blocks * (2 + 3 * (c.config.n_routed_experts + 1))


def test_every_cut_of_a_quantizable_linear_falls_on_a_hadamard_block_at_both_presets():
    from dspark_ray.config import full
    from dspark_ray.weights.inventory import tensor_specs
    from dspark_ray.weights.mix import GROUPS
    for cfg in (tiny(), full()):
        lay, n = Layout(cfg, 2), 0
        for name, spec in tensor_specs(cfg).items():
            if not any(fnmatch.fnmatchcase(name, p) for p in GROUPS.values()):
                continue
            assert all(d % 128 == 0 for d in spec.shape), name
            for r in (0, 1):
                s = lay.slice_of(name, spec.shape, r)
                if s is not None:
                    assert s[1] % 128 == 0 and s[2] % 128 == 0, (name, r, s)
                    n += 1
        assert n == 2 * (1 + cfg.n_blocks * (3 + 3 * (cfg.n_routed_experts + 1)))


def test_unaligned_slices_widen_to_hadamard_blocks_and_equal_the_full_reads_slice(kinds_dir):
    c = Checkpoint(kinds_dir)
    for name, dim, a, b in [("head.weight", 0, 5, 300), ("mtp.0.attn.wkv.weight", 1, 100, 200),
                            ("mtp.1.attn.wo_a.weight", 0, 100, 300), ("mtp.1.attn.wo_a.weight", 1, 3, 250),
                            ("mtp.2.ffn.experts.5.w2.weight", 1, 127, 129)]:
        assert torch.equal(c.read(name, dim, a, b), c.read(name).narrow(dim, a, b - a)), (name, dim, a, b)
    with pytest.raises(CheckpointError, match=r"not on 128-channel boundaries"):
        c.exl3("head.weight", 0, 5, 300)
    with pytest.raises(CheckpointError, match="stored as F16, not EXL3"):
        c.exl3("mtp.0.attn.wq_a.weight")


def _copy_without_manifest(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    t = load_file(str(src / ST))
    edit(t)
    save_tensors(dst / ST, t)
    return dst


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.pop("mtp.0.attn.wkv.mul1"), r"wkv\.trellis: bitrate 2\.5 needs the mul1 codebook"),
    (lambda t: t.pop("mtp.1.ffn.experts.3.w2.svh"), r"experts\.3\.w2\.svh: missing"),
    (lambda t: t.__setitem__("head.suh", t["head.suh"][:128].clone()), r"head\.suh: F16 \[128\], needs F16 \[256\]"),
    (lambda t: t.__setitem__("head.trellis", t["head.trellis"].float()), r"head\.trellis: F32 .*int16"),
    (lambda t: t.__setitem__("mtp.0.attn.wkv.mcg", torch.tensor(0, dtype=torch.int32)), "both codebook markers"),
    (lambda t: t.__setitem__("mtp.0.attn.wq_b.weight", torch.zeros(1024, 128, dtype=torch.float16)),
     r"mtp\.0\.attn\.wq_b\.weight: stored twice"),
    (lambda t: t.pop("mtp.2.attn.wo_a.slice.1.trellis"), r"wo_a\.slice\.1: wo_a group slice missing"),
])
def test_bad_exl3_storage_is_refused_by_name(kinds_dir, tmp_path, edit, words):
    d = _copy_without_manifest(kinds_dir, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=words):
        Checkpoint(d)


def test_plain_wo_a_slices_and_legacy_sign_bitfields_read_too(kinds_dir, tmp_path):
    c = Checkpoint(kinds_dir)
    wo_a = c.read("mtp.1.attn.wo_a.weight")
    head = c.exl3("head.weight")[0]
    signs = torch.where(head.suh < 0, -1.0, 1.0).half()             # .su holds signs only: +-1 per input channel
    bits = (signs < 0).to(torch.int64).view(-1, 16) << torch.arange(16)
    su = ((bits.sum(1) ^ 0x8000) - 0x8000).to(torch.int16)

    def edit(t):
        for g in range(c.config.o_groups):
            for part in ("trellis", "suh", "svh", "mcg"):
                t.pop(f"mtp.1.attn.wo_a.slice.{g}.{part}")
            t[f"mtp.1.attn.wo_a.slice.{g}.weight"] = wo_a[g * 128:(g + 1) * 128].clone()
        t.pop("head.suh")
        t["head.su"] = su
    d = Checkpoint(_copy_without_manifest(kinds_dir, tmp_path / "other", edit))
    assert d.storage("mtp.1.attn.wo_a.weight") == "slices" and torch.equal(d.read("mtp.1.attn.wo_a.weight"), wo_a)
    assert torch.equal(d.read("mtp.1.attn.wo_a.weight", 0, 100, 300), wo_a[100:300])
    want = exl3.reconstruct(head.trellis, signs, head.svh, head.codebook).T
    assert torch.equal(d.read("head.weight"), want) and torch.equal(d.read("head.weight", 1, 128, 256), want[:, 128:])


def test_a_wrong_codebook_marker_value_is_refused_on_read(kinds_dir, tmp_path):
    d = _copy_without_manifest(kinds_dir, tmp_path / "bad",
                               lambda t: t.__setitem__("mtp.0.attn.wkv.mul1", torch.tensor(7, dtype=torch.int32)))
    c = Checkpoint(d)
    with pytest.raises(CheckpointError, match=r"wkv\.mul1: holds 0x7, the mul1 codebook marker is 0x83dcd12d"):
        c.read("mtp.0.attn.wkv.weight")


def test_the_manifest_covers_every_stored_exl3_part(exl3_dir, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(exl3_dir, d)
    flip_stored_byte(d / ST, "mtp.2.ffn.experts.4.w3.trellis", 10)
    with pytest.raises(ManifestError, match=r"experts\.4\.w3\.trellis"):
        Checkpoint(d, verify_content=True)
    (d / MANIFEST_NAME).unlink()
    shutil.copy(exl3_dir / ST, d / ST)
    assert Checkpoint(d).identity_digest == read_manifest(exl3_dir)["identity_digest"]


def test_a_sharded_exl3_checkpoint_reads_the_same(exl3_dir, tmp_path):
    d = tmp_path / "sharded"
    synthesize(tiny(), d, fmt="exl3", shard_bytes=1 << 20)
    assert len(list(d.glob("model-*.safetensors"))) > 2
    a, b = Checkpoint(exl3_dir), Checkpoint(d, verify_content=True)
    assert a.identity_digest == b.identity_digest
    for n in ("head.weight", "mtp.2.attn.wo_a.weight", "mtp.1.ffn.experts.6.w2.weight"):
        assert torch.equal(a.read(n), b.read(n))


# ==== the drafter on an EXL3 checkpoint ==============================================================================
@pytest.mark.parametrize("which", ["exl3_dir", "kinds_dir"])
def test_the_emulated_pair_on_an_exl3_checkpoint_equals_the_split_reference_bit_for_bit(which, request):
    c = Checkpoint(request.getfixturevalue(which))
    rounds = workload.rounds(c.config, seed=11, n_requests=2, n_rounds=12, far_start=900)
    full = {n: c.read(n) for n in c.names()}
    split = parity.replay(make_drafter(c.config, "split", full=full), rounds)
    d0, d1 = make_emulated(c.config, ckpt=c)                     # each rank reads its own cut of the EXL3 tensors
    pair = run_pair(lambda: parity.replay(d0, rounds), lambda: parity.replay(d1, rounds))
    parity.assert_identical(split, parity.join_ranks(*pair), f"{which}: split vs emulated")
    drafts = torch.cat([e.drafts for r in split for e in r])
    conf = torch.cat([e.confidences for r in split for e in r])
    # Sensibly scaled weights: finite answers, varied drafts, confidences on both sides of the threshold.
    assert drafts.unique().numel() > drafts.numel() // 2
    assert bool(((conf > 0.5).any() & (conf < 0.5).any()).item()) and bool(torch.isfinite(conf).all())


def test_a_deployed_pair_serves_an_exl3_checkpoint_as_the_reference(ray_cluster, exl3_dir):
    """serve --checkpoint DIR on an EXL3 checkpoint: each rank decodes its cut on load; STEPs over the wire answer
    the in-process split reference's bits."""
    c = Checkpoint(exl3_dir)
    fe, host, port = deploy_pair(ray_cluster, exl3_dir, "exl3")
    try:
        ref = Driver(RankEngine(make_drafter(c.config, "split", ckpt=c), 2))
        with DrafterClient(host, port, timeout_s=60) as cl:
            cl.hello(client="test exl3", model_digest=c.identity_digest, config_digest=c.config.digest(), tp=2)
            grants = cl.acquire(2)
            for batch in workload.rounds(c.config, seed=4, n_requests=2, n_rounds=8, far_start=500):
                step_as_reference(cl, ref, grants, batch)
    finally:
        teardown("exl3")


def test_random_trellis_weights_have_the_plain_checkpoints_scale(exl3_dir, ckpt):
    c = Checkpoint(exl3_dir)
    for name in ("head.weight", "mtp.0.attn.wq_b.weight", "mtp.1.ffn.experts.2.w2.weight", "mtp.0.main_proj.weight"):
        a, b = c.read(name).float().std().item(), ckpt.read(name).float().std().item()
        assert 0.9 < a / b < 1.15, (name, a, b)


# ==== the device check's plumbing, with our decode standing in for exllamav3's kernels ===============================
def _device_check_module():
    spec = importlib.util.spec_from_file_location("exl3_device_check",
                                                  Path(__file__).resolve().parents[1] / "tools/exl3_device_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_device_check_counts_every_linear_and_cut_and_needs_cuda(kinds_dir, monkeypatch, capsys):
    tool = _device_check_module()

    class Stand:                            # LinearEXL3's surface the check uses, computed by our own decode
        def __init__(self, rec, dev, key):
            self.rec, self.in_features, self.out_features = rec, rec.in_features, rec.out_features

        def get_inner_weight_tensor(self):
            return exl3.inner_weight(self.rec.trellis, self.rec.codebook)

        def get_weight_tensor(self):
            return self.rec.weight()

    monkeypatch.setattr(tool, "_linear", Stand)
    monkeypatch.setattr(tool, "_fused", lambda lin: lin.rec.weight())
    c = Checkpoint(kinds_dir)
    out = tool.check_decode(c, "cpu", None)
    assert out["ok"] and out["failures"] == [] and out["torch_differ_weights"] == 0
    NB, E = c.config.n_blocks, c.config.n_routed_experts
    assert out["linears"] == 2 + NB * (3 + 3 * (E + 1)) + NB * c.config.o_groups      # wo_a: one per group
    assert out["cuts"] == out["cuts_equal"] == 2 * (1 + NB * (3 + 3 * (E + 1)))
    assert set(out["kinds"]) == {"6:3inst", "1:mcg", "3:mcg", "5:mul1", "2.5:mul1", "1.5:mul1", "8:3inst", "7:mcg"}
    monkeypatch.setattr(tool, "_fused", lambda lin: lin.rec.weight() * 2)          # a kernel that disagrees
    bad = tool.check_decode(c, "cpu", 1)
    assert not bad["ok"] and bad["failures"][0]["check"] in ("fused_equal_gpu", "fused_equal_cpu")
    assert bad["cpu_checked"] == len(bad["kinds"])
    if not torch.cuda.is_available():
        assert tool.main(["--skip-forward"]) == 2
        assert json.loads(capsys.readouterr().out)["error"] == "no CUDA device"


def test_row_blocks_multiply_like_the_concatenated_weight_and_slice_on_block_bounds():
    """kernels/exl3_gemm.RowBlocks (what torch.cat of EXL3 weights gives: one product per block) on plain blocks:
    the exact path's bits of the concatenated matrix, row slices on block boundaries only, and a clear error for
    any other tensor op on an EXL3 weight."""
    from dspark_ray.kernels.exl3_gemm import RowBlocks, _torch_function
    from dspark_ray.model import ops
    g = torch.Generator().manual_seed(3)
    a = torch.randn(256, 64, generator=g).half()
    b = torch.randn(128, 64, generator=g).half()
    x = torch.randn(5, 64, generator=g).half()
    rb = RowBlocks([a, b])
    assert tuple(rb.shape) == (384, 64)
    for dt in (torch.float16, torch.float32):
        assert torch.equal(ops.linear(x, rb, out_dtype=dt), ops.linear(x, torch.cat((a, b)), out_dtype=dt))
    assert rb[:256] is a and rb[256:] is b and rb[:] .shape == rb.shape
    with pytest.raises(ValueError, match="block boundary"):
        rb[:128]
    with pytest.raises(TypeError, match="not defined for EXL3 weights"):
        _torch_function(torch.add, (rb, rb), {})
