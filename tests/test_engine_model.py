"""The synthetic model an engine runs (weights/engine_model.py): trunk and drafter in one directory, what exllamav3's
DeepSeek-V4 loader reads, what dspark-ray serves from it, and the bigram that makes speculation real."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark_ray.config import load_config
from dspark_ray.rank.engine import RankEngine
from dspark_ray.rank.modes import make_drafter
from dspark_ray.weights.engine_model import (MARKOV_GAIN, drafter_successor, successor, trunk_specs,
                                             write_engine_model)
from dspark_ray.weights.loader import Checkpoint
from dspark_ray.weights.manifest import scan_safetensors
from dspark_ray.testing.batches import Driver, entry


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("engine_model")
    manifest = write_engine_model("tiny", d, seed=0, disagree=0.25)
    return d, manifest


def test_one_directory_holds_what_exllamav3_reads_for_trunk_and_drafter(model):
    d, _ = model
    raw = json.loads((d / "config.json").read_text())
    # exllamav3 1.6.5's DeepseekV4Config: required keys, MQA, every layer sliding, no hash layers, the mtp tail
    for k in ("hidden_size", "num_attention_heads", "q_lora_rank", "num_hidden_layers", "moe_intermediate_size",
              "n_routed_experts", "num_experts_per_tok", "vocab_size"):
        assert k in raw, k
    assert raw["architectures"] == ["DeepseekV4ForCausalLM"] and raw["num_key_value_heads"] == 1
    assert raw["num_hash_layers"] == 0 and set(raw["compress_ratios"]) == {0}
    cfg = load_config(d)
    assert len(raw["compress_ratios"]) == cfg.num_hidden_layers + cfg.n_blocks
    assert list(cfg.dspark_target_layer_ids) == list(range(cfg.num_hidden_layers - cfg.n_taps, cfg.num_hidden_layers))
    stored = {t.name for t in scan_safetensors(d / "model.safetensors")}
    for i in range(cfg.num_hidden_layers):        # each trunk layer: a drafter block's tensors under layers.i
        block = {n[len("mtp.0."):] for n in stored if n.startswith("mtp.0.")} - \
            {n for n in (s[len("mtp.0."):] for s in stored if s.startswith("mtp.0.")) if n.startswith("main_")}
        assert {n[len(f"layers.{i}."):] for n in stored if n.startswith(f"layers.{i}.")} == block
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"} <= stored
    assert {s.name for s in trunk_specs(cfg)} <= stored
    tok = json.loads((d / "tokenizer.json").read_text())
    assert tok["model"]["type"] == "WordLevel" and len(tok["model"]["vocab"]) == cfg.vocab_size
    assert tok["model"]["vocab"][" t"] == 4 and [t["content"] for t in tok["added_tokens"]] == \
        ["<bos>", "<eos>", "<pad>", "<unk>"]


def test_dspark_ray_serves_its_drafter_and_its_identity_is_the_writers_every_time(model, tmp_path):
    d, manifest = model
    ck = Checkpoint(d, verify_content=True)              # trunk tensors beside the drafter's are not its concern
    assert ck.identity_digest == manifest["identity_digest"]
    assert not any(n.startswith("layers.") for n in manifest["tensors"])
    again = write_engine_model("tiny", tmp_path / "again", seed=0, disagree=0.25)
    assert again["identity_digest"] == manifest["identity_digest"]
    other = write_engine_model("tiny", tmp_path / "other", seed=0, disagree=0.5)
    assert other["identity_digest"] != manifest["identity_digest"]


def test_the_trunks_bigram_has_wide_margins_and_the_drafter_follows_it_but_where_told_not_to(model):
    d, _ = model
    ck = Checkpoint(d)
    cfg = ck.config
    succ = successor(cfg.vocab_size, 0)
    ours = drafter_successor(succ, 0.25, 0)
    assert (succ[4:] >= 4).all() and len(set(succ[4:].tolist())) == cfg.vocab_size - 4     # one cycle, no specials
    assert abs((ours != succ).float().mean().item() - 0.25) < 0.03
    # the trunk's head on its embedding alone (its layers add little): argmax succ(t), by a wide margin
    e, h = ck.read("embed.weight").float(), ck.read("head.weight").float()
    top = ((e * torch.rsqrt(e.square().mean(1, keepdim=True))) @ h.T).topk(2, dim=1)
    assert torch.equal(top.indices[:, 0], succ)
    assert (top.values[:, 0] - top.values[:, 1]).min() > 5.0
    # the drafter's chain is the Markov head's: succ' from the seed on, whatever the context's taps
    drv = Driver(RankEngine(make_drafter(cfg, "split", ckpt=ck), 1))
    g = torch.Generator().manual_seed(1)
    agree = total = 0
    for _ in range(12):
        taps = (0.5 * torch.randn(10, cfg.n_taps * cfg.hidden_size, generator=g)).half().numpy()
        seed = int(torch.randint(4, cfg.vocab_size, (1,), generator=g))
        (r,) = drv.step([entry(slot=0, seed_token=seed, n_out=5, start_pos=0, token_ids=np.arange(10) + 4,
                               taps=taps)], resets=[0])
        chain = [seed]
        for _ in range(5):
            chain.append(int(ours[chain[-1]]))
        agree += sum(int(a == b) for a, b in zip(r.drafts_array().tolist(), chain[1:]))
        total += 5
        assert r.confident_len == 5                       # the confidence head's bias passes every draft
    assert agree == total
    assert MARKOV_GAIN > 0


def test_synth_writes_it_from_the_command_line(tmp_path, capsys):
    from dspark_ray.weights.synth_command import synth_main
    assert synth_main(["--preset", "tiny", "--with-trunk", "--out", str(tmp_path / "m"), "--disagree", "0.5"]) == 0
    assert "trunk and drafter" in capsys.readouterr().out
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dspark_engine_model"]["disagree"] == 0.5
    with pytest.raises(SystemExit):
        synth_main(["--preset", "tiny", "--with-trunk", "--format", "exl3", "--out", str(tmp_path / "x")])
