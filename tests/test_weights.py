"""Synthetic checkpoint, manifest and loader (CPU, tiny preset, one shared checkpoint)."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark_ray.config import tiny
from dspark_ray.weights.inventory import kind_of, tensor_specs
from dspark_ray.weights.loader import Checkpoint, CheckpointError, dequant_fp4, dequant_fp8
from dspark_ray.weights.manifest import MANIFEST_NAME, ManifestError, read_manifest, scan_safetensors
from dspark_ray.weights.synth import lowbias32, save_tensors, synthesize, uniform
from dspark_ray.weights.synth_command import synth_main

from conftest import flip_stored_byte

ST = "model.safetensors"


@pytest.fixture(scope="session")
def ckpt_dir(tiny_ckpt):
    return tiny_ckpt        # the session's tiny checkpoint (conftest); tests that change files copy it first


def _copy(src, tmp_path, name="c"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _rewrite(d, edit):
    """Load the single-file checkpoint, let `edit` change the dict of tensors, write it back."""
    tensors = load_file(str(d / ST))
    edit(tensors)
    save_tensors(d / ST, tensors)


# ---- RNG and synthesis --------------------------------------------------------------------------------------------
def test_tensor_hash_equals_python_integer_hash():
    rng = random.Random(1)
    xs = [0, 1, 0xFFFFFFFF, 0x80000000] + [rng.getrandbits(32) for _ in range(2000)]
    got = lowbias32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [lowbias32(x) for x in xs]         # no int64 overflow anywhere: the products are exact
    assert lowbias32(0x12345678) == lowbias32(0x12345678) & 0xFFFFFFFF


def test_uniform_stream_is_chunk_independent_and_in_range():
    whole = uniform(7, "x", 0, 10000)
    parts = torch.cat([uniform(7, "x", 0, 3000), uniform(7, "x", 3000, 7000)])
    assert torch.equal(whole, parts)
    assert whole.min() >= -1 and whole.max() < 1 and abs(whole.mean()) < 0.05


def test_same_seed_gives_identical_files_and_digest(ckpt_dir, tmp_path):
    assert synth_main(["--preset", "tiny", "--out", str(tmp_path / "again"), "--device", "cpu"]) == 0
    for f in ("config.json", ST, MANIFEST_NAME):
        assert (ckpt_dir / f).read_bytes() == (tmp_path / "again" / f).read_bytes(), f


def test_other_seed_changes_digest(ckpt_dir, tmp_path):
    m1 = synthesize(tiny(), tmp_path / "s1", seed=1)
    m0 = read_manifest(ckpt_dir)
    assert m1["identity_digest"] != m0["identity_digest"]
    assert m1["config_digest"] == m0["config_digest"]


def test_checkpoint_holds_exactly_the_inventory_in_storage_dtypes(ckpt_dir):
    specs = tensor_specs(tiny())
    stored = {t.name: t for t in scan_safetensors(ckpt_dir / ST)}
    assert set(stored) == set(specs)
    tags = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}
    for name, s in specs.items():
        assert stored[name].shape == s.shape and stored[name].dtype == tags[s.dtype], name
    sink = load_file(str(ckpt_dir / ST))["mtp.0.attn.attn_sink"]
    assert (sink != 0).all()


# ---- manifest -----------------------------------------------------------------------------------------------------
def test_identity_without_manifest_equals_manifest_identity(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    (d / MANIFEST_NAME).unlink()
    assert Checkpoint(d).identity_digest == read_manifest(ckpt_dir)["identity_digest"]


@pytest.mark.parametrize("tamper, words", [
    (lambda t: t.__setitem__("mtp.0.attn_norm.weight", t["mtp.0.attn_norm.weight"][:-1].clone()), "shape"),
    (lambda t: t.__setitem__("mtp.1.attn.attn_sink", t["mtp.1.attn.attn_sink"].half()), "dtype"),
    (lambda t: t.pop("mtp.2.ffn.experts.7.w2.weight"), "missing"),
])
def test_manifest_refuses_tampered_layout(ckpt_dir, tmp_path, tamper, words):
    d = _copy(ckpt_dir, tmp_path)
    _rewrite(d, tamper)
    with pytest.raises(ManifestError, match=words):
        Checkpoint(d)


def test_verify_content_refuses_a_flipped_byte(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    flip_stored_byte(d / ST, "mtp.1.attn.wkv.weight", 100)
    Checkpoint(d)                                   # layout still matches: only the content check sees it
    with pytest.raises(ManifestError, match="mtp.1.attn.wkv.weight"):
        Checkpoint(d, verify_content=True)
    Checkpoint(ckpt_dir, verify_content=True)


def test_inventory_check_names_missing_and_misshapen_tensors(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    (d / MANIFEST_NAME).unlink()
    _rewrite(d, lambda t: t.pop("mtp.1.attn.wq_a.weight"))
    with pytest.raises(CheckpointError, match=r"mtp\.1\.attn\.wq_a\.weight.*missing"):
        Checkpoint(d)
    _rewrite(d, lambda t: t.__setitem__("mtp.1.attn.wq_a.weight", torch.zeros(128, 255, dtype=torch.float16)))
    with pytest.raises(CheckpointError, match=r"wq_a\.weight: shape \[128, 255\], expected \[128, 256\]"):
        Checkpoint(d)


# ---- layouts and configs ------------------------------------------------------------------------------------------
def test_sharded_checkpoint_loads_the_same_tensors(ckpt, tmp_path):
    d = tmp_path / "sharded"
    synthesize(tiny(), d, seed=0, shard_bytes=4 << 20)
    assert (d / "model.safetensors.index.json").exists() and not (d / ST).exists()
    assert len(list(d.glob("model-*.safetensors"))) > 2
    sharded = Checkpoint(d, verify_content=True)
    assert sharded.identity_digest == ckpt.identity_digest      # the shard layout is not part of the identity
    assert sharded.names() == ckpt.names()
    for n in ckpt.names():
        assert torch.equal(sharded.read(n), ckpt.read(n)), n


def test_loose_safetensors_files_without_index_load(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    tensors = load_file(str(d / ST))
    (d / ST).unlink()
    names = sorted(tensors)
    save_tensors(d / "a.safetensors", {k: tensors[k] for k in names[::2]})
    save_tensors(d / "b.safetensors", {k: tensors[k] for k in names[1::2]})
    assert Checkpoint(d, verify_content=True).identity_digest == read_manifest(ckpt_dir)["identity_digest"]


def test_nested_text_config_gives_the_same_config(ckpt_dir, ckpt, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    flat = json.loads((d / "config.json").read_text())
    nested = {"architectures": flat.pop("architectures"), "text_config": flat}
    (d / "config.json").write_text(json.dumps(nested))
    c = Checkpoint(d)
    assert c.config == ckpt.config and c.identity_digest == ckpt.identity_digest


def test_dspark_expert_fields_override_trunk_moe_fields(ckpt_dir, tmp_path):
    d = _copy(ckpt_dir, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw.update(n_routed_experts=384, num_experts_per_tok=6, dspark_n_routed_experts=8, dspark_num_experts_per_tok=3)
    (d / "config.json").write_text(json.dumps(raw))
    c = Checkpoint(d)
    assert (c.config.n_routed_experts, c.config.num_experts_per_tok) == (8, 3)
    # Without the drafter fields the trunk's 16 experts are expected, and expert 8 is not there.
    raw = {k: v for k, v in raw.items() if not k.startswith("dspark_n_") and k != "dspark_num_experts_per_tok"}
    raw.update(n_routed_experts=16)
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="config_digest"):
        Checkpoint(d)
    (d / MANIFEST_NAME).unlink()
    with pytest.raises(CheckpointError, match=r"mtp\.0\.ffn\.experts\.8\.w1\.weight.*missing"):
        Checkpoint(d)


def test_tied_embeddings_serve_embed_as_fp16_head(tmp_path):
    cfg = tiny().replace(tie_word_embeddings=True)
    d = tmp_path / "tied"
    synthesize(cfg, d)
    assert "head.weight" not in {t.name for t in scan_safetensors(d / ST)}
    c = Checkpoint(d)
    assert "head.weight" in c.names() and c.shape("head.weight") == (4096, 256)
    head = c.read("head.weight")
    assert head.dtype == torch.float16 and torch.equal(head, c.read("embed.weight").half())
    assert torch.equal(c.read("head.weight", 0, 2048, 4096), head[2048:])


# ---- reads --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, dim, start, stop", [
    ("head.weight", 0, 2048, 4096),
    ("mtp.2.markov_head.markov_w2.weight", 0, 0, 2048),
    ("mtp.0.attn.wq_b.weight", 0, 512, 1024),
    ("mtp.0.attn.wo_b.weight", 1, 256, 512),
    ("mtp.1.attn.attn_sink", 0, 4, 8),
    ("mtp.1.ffn.experts.3.w2.weight", 1, 128, 256),
    ("embed.weight", 0, 1, 3),
    ("mtp.0.attn_norm.weight", 0, 0, 1),
])
def test_slice_read_equals_full_read_slice(ckpt, name, dim, start, stop):
    full = ckpt.read(name)
    part = ckpt.read(name, dim, start, stop)
    assert part.dtype == full.dtype and torch.equal(part, full.narrow(dim, start, stop - start))


def test_bad_slices_are_refused(ckpt):
    with pytest.raises(ValueError, match=r"slice \[0, 4097\)"):
        ckpt.read("head.weight", 0, 0, 4097)
    with pytest.raises(ValueError, match="dim 2"):
        ckpt.read("head.weight", 2, 0, 1)


def test_compute_form_dtypes(ckpt):
    want = {"linear": torch.float16, "linear_bias": torch.float16, "norm": torch.bfloat16,
            "table": torch.bfloat16, "fp32": torch.float32}
    for n in ckpt.names():
        t = ckpt.read(n)
        assert t.dtype == want[kind_of(n)] and tuple(t.shape) == ckpt.shape(n), n


# ---- other storage forms: conversions, fallbacks, FP8 / FP4 -------------------------------------------------------
def test_dequant_fp8_by_hand():
    w = torch.tensor([[1.0, -2.0, 0.5, 3.0],
                      [0.25, 1.5, -1.0, 6.0],
                      [4.0, -0.5, 2.0, 1.0],
                      [-3.0, 0.75, 1.0, -1.0]]).to(torch.float8_e4m3fn)
    # E8M0 bytes: 127 -> 1, 128 -> 2, 125 -> 1/4, 130 -> 8; one per 2 x 2 block
    s = torch.tensor([[127, 128], [125, 130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = torch.tensor([[1.0, -2.0, 1.0, 6.0],
                         [0.25, 1.5, -2.0, 12.0],
                         [1.0, -0.125, 16.0, 8.0],
                         [-0.75, 0.1875, 8.0, -8.0]], dtype=torch.float16)
    assert torch.equal(dequant_fp8(w, s), want)


def test_dequant_fp4_by_hand():
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    rng = random.Random(3)
    codes = [[rng.randrange(16) for _ in range(64)] for _ in range(2)]
    packed = torch.tensor([[row[2 * j] | (row[2 * j + 1] << 4) for j in range(32)] for row in codes],
                          dtype=torch.uint8)
    exps = [[127, 129], [126, 127]]                 # blocks [1, 32]: x1, x4 / x0.5, x1
    s = torch.tensor(exps, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    want = torch.tensor([[(-1 if c & 8 else 1) * lut[c & 7] * 2.0 ** (exps[i][j // 32] - 127)
                          for j, c in enumerate(row)] for i, row in enumerate(codes)], dtype=torch.float16)
    assert torch.equal(dequant_fp4(packed.view(torch.int8), s), want)


@pytest.fixture(scope="module")
def other_storage(ckpt_dir, tmp_path_factory):
    """The tiny checkpoint re-stored the ways a real one may be: FP8 dense linear, FP4 expert, bf16/fp32 linears,
    fp32 norm, DeepSeek's routing-bias name, the optional biases. No manifest (the names changed)."""
    d = tmp_path_factory.mktemp("other")
    for f in ("config.json", ST):
        shutil.copy(ckpt_dir / f, d / f)
    t = load_file(str(d / ST))
    orig = dict(t)
    t["mtp.0.attn.wkv.weight"] = orig["mtp.0.attn.wkv.weight"].to(torch.float8_e4m3fn)          # (128, 256)
    t["mtp.0.attn.wkv.scale"] = torch.tensor([[126, 128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (256, 128), dtype=torch.uint8, generator=g)                  # expert (256, 256)
    t["mtp.1.ffn.experts.2.w1.weight"] = packed.view(torch.int8)
    t["mtp.1.ffn.experts.2.w1.scale"] = torch.randint(120, 130, (256, 8), dtype=torch.uint8, generator=g).view(
        torch.float8_e8m0fnu)
    t["mtp.0.attn.wq_a.weight"] = orig["mtp.0.attn.wq_a.weight"].to(torch.bfloat16)
    t["mtp.0.attn.wq_b.weight"] = orig["mtp.0.attn.wq_b.weight"].float()
    t["mtp.0.attn_norm.weight"] = orig["mtp.0.attn_norm.weight"].float()
    t["mtp.1.ffn.gate.e_score_correction_bias"] = t.pop("mtp.1.ffn.gate.bias")
    t["mtp.2.markov_head.markov_w2.bias"] = torch.linspace(-1, 1, 4096)
    t["mtp.2.confidence_head.proj.bias"] = torch.tensor([0.25], dtype=torch.bfloat16)
    save_tensors(d / ST, t)
    return d, orig, t


def test_other_storage_converts_to_the_compute_form(other_storage):
    d, orig, t = other_storage
    c = Checkpoint(d)
    wkv = c.read("mtp.0.attn.wkv.weight")
    assert wkv.dtype == torch.float16
    want = orig["mtp.0.attn.wkv.weight"].to(torch.float8_e4m3fn).float()
    want[:, :128] *= 0.5
    want[:, 128:] *= 2.0
    assert torch.equal(wkv, want.half())
    assert torch.equal(c.read("mtp.1.ffn.experts.2.w1.weight"),
                       dequant_fp4(t["mtp.1.ffn.experts.2.w1.weight"], t["mtp.1.ffn.experts.2.w1.scale"]))
    assert c.shape("mtp.1.ffn.experts.2.w1.weight") == (256, 256)
    assert torch.equal(c.read("mtp.0.attn.wq_a.weight"), orig["mtp.0.attn.wq_a.weight"].to(torch.bfloat16).half())
    assert torch.equal(c.read("mtp.0.attn.wq_b.weight"), orig["mtp.0.attn.wq_b.weight"])   # fp16 -> fp32 -> fp16
    norm = c.read("mtp.0.attn_norm.weight")
    assert norm.dtype == torch.float16 and torch.equal(norm, orig["mtp.0.attn_norm.weight"].half())
    bias = c.read("mtp.1.ffn.gate.bias")
    assert bias.dtype == torch.float32 and torch.equal(bias, orig["mtp.1.ffn.gate.bias"])
    assert c.read("mtp.2.markov_head.markov_w2.bias").dtype == torch.float16
    assert c.read("mtp.2.confidence_head.proj.bias").dtype == torch.float16
    assert "mtp.2.markov_head.markov_w2.bias" in c.names() and "mtp.1.ffn.gate.bias" in c.names()


@pytest.mark.parametrize("name, dim, start, stop", [
    ("mtp.0.attn.wkv.weight", 0, 5, 77),
    ("mtp.0.attn.wkv.weight", 1, 100, 200),          # crosses a 128-column scale block
    ("mtp.1.ffn.experts.2.w1.weight", 1, 40, 130),   # FP4: odd bounds inside packed bytes and [1, 32] blocks
    ("mtp.1.ffn.experts.2.w1.weight", 0, 128, 256),
])
def test_quantized_slice_read_equals_full_read_slice(other_storage, name, dim, start, stop):
    c = Checkpoint(other_storage[0])
    assert torch.equal(c.read(name, dim, start, stop), c.read(name).narrow(dim, start, stop - start))


def test_non_finite_fp16_conversion_is_refused(ckpt_dir, tmp_path):
    d = tmp_path / "big"
    d.mkdir()
    shutil.copy(ckpt_dir / "config.json", d)
    t = load_file(str(ckpt_dir / ST))
    w = t["mtp.0.attn.wq_a.weight"].float()
    w[3, 5] = 1e6                                    # > fp16 max 65504
    t["mtp.0.attn.wq_a.weight"] = w
    save_tensors(d / ST, t)
    with pytest.raises(CheckpointError, match=r"wq_a\.weight: element 773 is 1000000\.0.*finite"):
        Checkpoint(d).read("mtp.0.attn.wq_a.weight")


def test_fp8_without_scale_is_refused(ckpt_dir, tmp_path):
    d = tmp_path / "noscale"
    d.mkdir()
    shutil.copy(ckpt_dir / "config.json", d)
    t = load_file(str(ckpt_dir / ST))
    t["mtp.0.attn.wkv.weight"] = t["mtp.0.attn.wkv.weight"].to(torch.float8_e4m3fn)
    save_tensors(d / ST, t)
    with pytest.raises(CheckpointError, match=r"wkv\.weight: stored as F8_E4M3.*wkv\.scale"):
        Checkpoint(d)


# ---- the staged read (weights/staging.py, a restart's weights) ----------------------------------------------------
def test_a_staged_read_is_the_files_bytes_across_chunks_and_a_short_file_is_an_error(tmp_path):
    from dspark_ray.weights.staging import Staging
    data = bytes(random.Random(3).getrandbits(8) for _ in range(10_000))
    f = tmp_path / "blob"
    f.write_bytes(data)
    with Staging("cpu", threads=3, chunk_bytes=999) as st:          # chunks that split every way
        for lo, hi in ((0, 10_000), (1, 9_999), (4_000, 4_001), (7, 7), (998, 2_998)):
            assert bytes(st.read(f, lo, hi).numpy()) == data[lo:hi], (lo, hi)
        with pytest.raises(EOFError, match="before the tensor's end"):
            st.read(f, 9_000, 11_000)


def _through(source: str, ck, device: str):
    from dspark_ray.weights.host_copy import HostCopy
    from dspark_ray.weights.staging import Staging
    return Staging(device, chunk_bytes=4096) if source == "staging" else HostCopy(ck.spans(), device)


def _read_rank_through(ck, tp, rank, source, device):
    from dspark_ray.model.layout import Layout
    from dspark_ray.rank.modes import read_rank
    layout = Layout(ck.config, tp)
    with _through(source, ck, device) as st:
        staged = read_rank(ck, layout, rank, device=device, staging=st)
        assert st.bytes_read > 0
        if source == "host_copy" and device != "cpu":
            assert st._registered, "the spans were not pinned"
    plain = read_rank(ck, layout, rank)
    assert plain.keys() == staged.keys()
    for n in plain:
        assert plain[n].dtype == staged[n].dtype and torch.equal(plain[n], staged[n].cpu()), n


@pytest.mark.parametrize("source", ["staging", "host_copy"])
@pytest.mark.parametrize("tp,rank", [(1, 0), (2, 0), (2, 1)])
def test_a_rank_read_through_the_staging_equals_the_plain_read(ckpt_dir, tp, rank, source):
    """Every tensor of a rank's cut (whole, row cuts read as byte ranges, column cuts as before) in the same dtype
    and bits as without the staging, through bounce buffers or a spare's mapped files."""
    _read_rank_through(Checkpoint(ckpt_dir), tp, rank, source, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["staging", "host_copy"])
def test_a_rank_read_onto_the_card_through_pinned_files_equals_the_plain_read(ckpt_dir, source):
    _read_rank_through(Checkpoint(ckpt_dir), 2, 1, source, "cuda")


def test_the_host_copy_keeps_only_the_drafters_bytes_and_refuses_reads_outside_them(ckpt_dir):
    from dspark_ray.weights.host_copy import HostCopy
    ck = Checkpoint(ckpt_dir)
    (path, (begin, end)), = ck.spans().items()
    assert 8 < begin < end <= Path(path).stat().st_size        # after the safetensors header
    with HostCopy(ck.spans(), "cpu") as hc:
        assert bytes(hc.read(path, begin, begin + 16).numpy()) == Path(path).read_bytes()[begin:begin + 16]
        with pytest.raises(ValueError, match="outside the pinned span"):
            hc.read(path, begin, end + 1)
