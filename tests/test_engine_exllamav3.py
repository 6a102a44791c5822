"""The exllamav3 adapter's bookkeeping against a real tiny deployment (Ray, tp2 over gloo, STEP over TCP), driven by
the calls exllamav3's generator makes (support/generator_calls.py, plain tensors: no exllamav3 on the CPU). Every
draft it returns as OK equals what the in-process reference drafts for the same context and seed."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from dspark_ray.actors.placement import teardown
from dspark_ray.contract import Code
from dspark_ray.engine import RankEngine
from dspark_ray.engines.exllamav3 import RemoteDrafter
from dspark_ray.modes import make_drafter
from support.batches import Driver, entry
from support.generator_calls import GeneratorCalls

from conftest import deploy_pair

SLOTS = 3


@pytest.fixture(scope="module")
def worker(ray_cluster, tiny_ckpt):
    fe, host, port = deploy_pair(ray_cluster, tiny_ckpt, "engine", n_slots=SLOTS, collective_timeout_s=1.5)
    yield fe, f"{host}:{port}"
    teardown("engine")


@pytest.fixture
def engine(worker, cfg):
    calls = GeneratorCalls(cfg.n_taps, cfg.hidden_size, cfg.vocab_size)
    calls.drafter = RemoteDrafter(worker[1], cfg, deadline_ms=30_000, timeout_s=60, spin_us=0,
                                  tokens=calls.token_ids)
    yield calls
    calls.drafter.close()


class Reference:
    """The in-process drafter: a fresh slot given a sequence's last window and its seed, every time."""

    def __init__(self, cfg, ckpt):
        self.cfg, self.driver = cfg, Driver(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 1))

    def drafts(self, seq) -> list[int]:
        start = max(0, seq.kv - self.cfg.sliding_window)
        e = entry(slot=0, seed_token=seq.tokens[-1], n_out=self.cfg.block_size, start_pos=start,
                  token_ids=np.asarray(seq.tokens[start:seq.kv]), taps=np.stack(seq.taps[start:seq.kv]))
        (r,) = self.driver.step([e], resets=[0])
        assert r.code == Code.OK, r.reason
        return r.drafts_array().tolist()


@pytest.fixture(scope="module")
def reference(cfg, ckpt):
    return Reference(cfg, ckpt)


def draft_round(calls, ref, seqs, accepted):
    """One round: draft, check every OK row against the reference, verify with `accepted` drafts a row. Returns the
    rows' codes and the draft_confidence_len the generator read."""
    drafts, conf = calls.draft(seqs)
    codes = list(calls.drafter.last_codes)
    for i, (s, code) in enumerate(zip(seqs, codes)):
        if code == Code.OK:
            assert drafts[i].tolist() == ref.drafts(s), (i, s.kv)
        else:                                    # no drafts from the service: the seed stands in, never a guess
            assert drafts[i].tolist() == [s.tokens[-1]] * drafts.shape[1]
    calls.verify(seqs, drafts if conf else None, accepted)
    return codes, conf


def held(worker, ray_cluster) -> int:
    return ray_cluster.get(worker[0].status.remote())["slots"]["held"]


def test_generator_rounds_draft_as_the_reference_and_ended_jobs_give_their_slots_back(engine, reference, worker,
                                                                                     ray_cluster, cfg):
    W = cfg.sliding_window
    # prompts shorter and longer than the window, one prefilled in chunks (the generator's shared chunk size)
    seqs = [engine.start(5), engine.start(3 * W + 2, chunk=W), engine.start(W + 1)]
    for rnd, acc in enumerate([[5, 0, 2], [1, 5, 0], [3, 3, 3], [0, 0, 0], [5, 5, 5]]):
        codes, conf = draft_round(engine, reference, seqs, acc)
        assert codes == [Code.OK] * 3, (rnd, codes)
        assert conf is not None and 0 <= conf <= cfg.block_size
    assert held(worker, ray_cluster) == 3
    # a job ends: the next round without it gives its slot back; a new job takes its pages and a slot
    engine.end(seqs.pop(0))
    codes, _ = draft_round(engine, reference, seqs, [2, 4])
    assert codes == [Code.OK] * 2 and held(worker, ray_cluster) == 2
    assert engine.drafter.stats["released"] == 1
    seqs.append(engine.start(W // 2))
    for acc in ([1, 1, 1], [4, 0, 5]):
        codes, _ = draft_round(engine, reference, seqs, acc)
        assert codes == [Code.OK] * 3
    assert engine.drafter.stats["unknown_rows"] == engine.drafter.stats["partial_windows"] == 0


def test_a_failed_batch_verifies_without_drafts_and_the_next_round_re_inserts_the_last_window(engine, reference,
                                                                                             worker, ray_cluster):
    seqs = [engine.start(11), engine.start(4)]
    assert draft_round(engine, reference, seqs, [2, 2])[0] == [Code.OK] * 2
    ray_cluster.get(worker[0].set_fault.remote(0, "raise", count=1))
    codes, conf = draft_round(engine, reference, seqs, [0, 0])
    assert codes == [Code.INTERNAL] * 2 and conf == 0            # the generator skips drafting this round
    for acc in ([3, 1], [5, 5]):                                  # resynced slots: each re-inserts its last window
        assert draft_round(engine, reference, seqs, acc)[0] == [Code.OK] * 2


def test_a_sequence_without_a_free_slot_drafts_nothing_until_one_is_given_back(engine, reference, worker,
                                                                             ray_cluster):
    seqs = [engine.start(6 + k) for k in range(SLOTS + 1)]
    for _ in range(3):
        codes, _ = draft_round(engine, reference, seqs, [1] * len(seqs))
        assert codes.count(Code.OK) == SLOTS and codes[-1] is None    # the pool ran out: the last row waits ...
    assert engine.drafter.stats["acquire_refused"] == 1             # ... without asking again every round
    engine.end(seqs.pop(0))
    codes, _ = draft_round(engine, reference, seqs, [2] * len(seqs))
    assert codes == [Code.OK] * SLOTS                             # the freed slot went to the waiting sequence


def test_a_model_with_another_tap_count_is_refused_at_construction(worker, cfg):
    from dspark_ray.client import ClientError
    other = cfg.replace(dspark_target_layer_ids=(1, 2))
    with pytest.raises(ClientError, match="taps 3, the model has 2"):
        RemoteDrafter(worker[1], other, timeout_s=60)


def test_the_readmes_exllamav3_lines_call_the_adapters_own_api():
    """The README's "From exllamav3" block (run for real by the GPU test) names RemoteDrafter's arguments and
    methods as they are."""
    import inspect
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "RemoteDrafter(" in b)
    params = inspect.signature(RemoteDrafter).parameters
    for kw in re.findall(r"RemoteDrafter\([^)]*?(\w+)=", block):
        assert kw in params, kw
    for method in re.findall(r"drafter\.(\w+)\(", block):
        assert callable(getattr(RemoteDrafter, method, None)), method
