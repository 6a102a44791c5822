"""The exllamav3 adapter against a real tiny deployment (Ray, one rank, STEP over TCP), driven by the calls
exllamav3's generator makes (dspark_ray/testing/generator_calls.py: its jobs, pages, prefix cache and call order on plain
tensors; no exllamav3 on the CPU). Every draft it returns as OK equals what the in-process reference drafts for the
same context and seed; no schedule and no failure makes it raise into the generator."""
from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest

from dspark_ray.actors.placement import teardown
from dspark_ray.protocol.contract import Code
from dspark_ray.rank.engine import RankEngine
from dspark_ray.engines.exllamav3 import RemoteDrafter
from dspark_ray.rank.modes import make_drafter
from dspark_ray.testing.batches import Driver, entry
from dspark_ray.testing.generator_calls import GeneratorCalls

from conftest import deploy_pair

SLOTS = 3
FAULT_DEADLINE_MS = 400.0      # the fault tests' STEP budget: a tiny one-rank step takes tens of ms on this CPU


@pytest.fixture(scope="module")
def worker(ray_cluster, tiny_ckpt):
    # One rank: a frozen rank then holds its STEP past the deadline without a peer's collective timing out.
    fe, host, port = deploy_pair(ray_cluster, tiny_ckpt, "engine", tp=1, n_slots=SLOTS, collective_timeout_s=1.5)
    yield fe, f"{host}:{port}"
    teardown("engine")


def make_engine(worker, cfg, **kw):
    calls = GeneratorCalls(cfg.n_taps, cfg.hidden_size, cfg.vocab_size, window=cfg.block_size)
    calls.draft_model = RemoteDrafter(worker[1], cfg, **({"deadline_ms": 30_000, "timeout_s": 60} | kw))
    calls.draft_model.bind(calls)
    return calls


@pytest.fixture
def engine(worker, cfg):
    calls = make_engine(worker, cfg)
    yield calls
    calls.drafter.close()


class Reference:
    """The in-process drafter (one rank, as deployed): a fresh slot given a sequence's last window and its seed."""

    def __init__(self, cfg, ckpt):
        self.cfg, self.driver = cfg, Driver(RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), 1))

    def drafts(self, seq) -> list[int]:
        kv = seq.kv_position
        start = max(0, kv - self.cfg.sliding_window)
        e = entry(slot=0, seed_token=seq.tokens[kv], n_out=self.cfg.block_size, start_pos=start,
                  token_ids=np.asarray(seq.tokens[start:kv]), taps=np.stack(seq.taps[start:kv]) if kv else None)
        (r,) = self.driver.step([e], resets=[0])
        assert r.code == Code.OK, r.reason
        return r.drafts_array().tolist()


@pytest.fixture(scope="module")
def reference(cfg, ckpt):
    return Reference(cfg, ckpt)


class Checked:
    """A round's check: every OK row drafts as the reference, every other row drafts nothing (the seed stands in,
    never a guess); the codes of each round are kept."""

    def __init__(self, calls, ref):
        self.calls, self.ref, self.codes, self.ok = calls, ref, [], 0

    def __call__(self, rnd) -> None:
        codes = list(self.calls.drafter.last_codes)
        assert len(codes) == len(rnd.jobs)
        self.codes.append(codes)
        for i, (job, code) in enumerate(zip(rnd.jobs, codes)):
            if code == Code.OK:
                assert rnd.drafts[i].tolist() == self.ref.drafts(job.seq), (i, job.seq.kv_position)
                self.ok += 1
            else:
                assert rnd.drafts[i].tolist() == [job.seq.tokens[-1]] * rnd.drafts.shape[1]


def test_a_mixed_schedule_drafts_as_the_reference_and_never_raises(engine, reference, worker, ray_cluster, cfg):
    """The schedule that crashed the generator (issue 62): short and long prompts (one past a page and a prefill
    chunk), jobs ending at different times on max_new_tokens or a stop token, jobs joining mid-generation, a repeated
    prompt starting on the prefix cache's pages, more live jobs than the service's slots."""
    engine.chunk = 300
    long_prompt = engine.prompt(700)
    check = Checked(engine, reference)
    stop = 7
    engine.start(3, max_new=3)
    engine.start(long_prompt, max_new=40)
    engine.start(40, max_new=30, stop={stop}, prefill=False)
    engine.start(1, max_new=9)
    bonus = iter(list(range(100, 140)) + [stop] + list(range(200, 600)))
    accept = iter([2, 0, 1, 5, 0, 3] * 100)
    rounds = 0
    while engine.active_jobs:
        engine.iterate(accept=lambda j: next(accept), bonus=lambda j: next(bonus), check=check)
        rounds += 1
        if rounds == 3:                                    # joining mid-generation: a repeat of the long prompt
            repeat = engine.start(long_prompt + engine.prompt(3), max_new=10, prefill=False)
            assert repeat.cached_positions == 512          # ... on two pages of the prefix cache
        if rounds == 5:
            engine.start(260, max_new=16)
    stats = engine.drafter.stats
    assert stats["failures"] == 0 and stats["unmatched_rows"] == 0
    assert check.ok >= 20 and stats["prefix_hits"] == 1
    assert max(len(c) for c in check.codes) > SLOTS          # more live jobs than slots: some rows waited
    # every job ended in a verification: its slot came back there, with no draft call after it
    assert ray_cluster.get(worker[0].status.remote())["slots"]["held"] == 0


def wait_for(cond, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"waited {timeout_s} s for: {what}"
        time.sleep(0.05)


def held(worker, ray_cluster) -> int:
    return ray_cluster.get(worker[0].status.remote())["slots"]["held"]


def schedule(calls, check, rounds: int = 8) -> list:
    """Three jobs, a fourth joining at the third round; the drafts and codes of every round."""
    calls.start(11, max_new=40)
    calls.start(4, max_new=40)
    calls.start(30, max_new=40)
    out = []
    for k in range(rounds):
        if k == 2:
            calls.cancel(calls.active_jobs[0])
            calls.start(9, max_new=40)
        r = calls.iterate(accept=lambda j: j.identifier % 4, check=check)
        out.append((r.drafts.tolist(), list(calls.drafter.last_codes)))
    return out


def test_the_early_step_changes_no_draft_and_forward_only_reads_it(worker, reference, cfg):
    """The same schedule with the STEP sent at verification and from `forward` (blocking): the same drafts and codes
    every round. Early, each round's STEP left at the previous verification; only a job's first draft (a new job,
    its prefill just done) takes a second STEP."""
    runs = {}
    for early in (True, False):
        calls = make_engine(worker, cfg, early=early)
        check = Checked(calls, reference)
        runs[early] = schedule(calls, check)
        stats = calls.drafter.stats
        calls.drafter.close()
        assert stats["failures"] == 0 and check.ok == stats["rows"] == 3 * 8
        if early:
            assert stats["second_steps"] == 2 and stats["early_used"] == stats["rows"] - 4
        else:
            assert stats["early_entries"] == 0 and stats["second_steps"] == 8
    assert runs[True] == runs[False]


def test_a_job_that_leaves_between_verification_and_draft_gives_its_slot_back(engine, reference, worker,
                                                                                ray_cluster):
    check = Checked(engine, reference)
    a, b = engine.start(12, max_new=40), engine.start(20, max_new=40)
    for _ in range(2):
        engine.iterate(accept=2, check=check)
    sent = engine.drafter.stats["early_entries"]
    engine.cancel(b)                                   # its entry left with the early STEP already
    engine.iterate(accept=2, check=check)
    assert engine.drafter.stats["early_entries"] == sent + 1 and held(worker, ray_cluster) == 1
    assert check.codes[-1] == [Code.OK] and check.ok == 5


@pytest.mark.parametrize("fault", ["deadline", "internal", "unavailable"])
def test_an_early_step_answered_other_than_ok_drafts_nothing_that_round_and_drafting_resumes(
        worker, reference, ray_cluster, cfg, fault):
    """DEADLINE: the rank froze past the STEP's budget (its late answer is dropped); INTERNAL: the batch failed;
    UNAVAILABLE: the connection was lost with the early STEP in flight (the worker is reconnected and new slots
    acquired). Every round after it drafts as the reference wherever it drafts, and drafting resumes."""
    calls = make_engine(worker, cfg, deadline_ms=FAULT_DEADLINE_MS)
    try:
        check = Checked(calls, reference)
        calls.start(14, max_new=200)
        calls.start(6, max_new=200)
        for _ in range(2):
            calls.iterate(accept=1, check=check)
        assert check.codes[-1] == [Code.OK] * 2

        def arm(rnd):            # after this round's draft, before its verification sends the next STEP
            check(rnd)
            if fault == "deadline":
                ray_cluster.get(worker[0].set_fault.remote(0, "stall", count=1, seconds=1.5))
            elif fault == "internal":
                ray_cluster.get(worker[0].set_fault.remote(0, "raise", count=1))

        calls.iterate(accept=1, check=arm)
        assert calls.drafter.pool.pending is not None                  # the early STEP the fault strikes
        if fault == "unavailable":
            calls.drafter.pool.workers[0].client._sock.shutdown(socket.SHUT_RDWR)
        calls.iterate(accept=1, check=check)
        want = {"deadline": Code.DEADLINE, "internal": Code.INTERNAL, "unavailable": Code.UNAVAILABLE}[fault]
        assert check.codes[-1] == [want] * 2, check.codes[-1]
        if fault == "unavailable":          # the pool reconnects in the background (retry_s)
            wait_for(lambda: calls.drafter.pool.status()[0]["down"] is None, 30, "the worker reconnected")
        resumed = None
        for k in range(60):
            calls.iterate(accept=1, check=check)
            if check.codes[-1] == [Code.OK] * 2:
                resumed = k
                break
        assert resumed is not None, check.codes[-8:]
        assert calls.drafter.stats["failures"] == 0
    finally:
        calls.drafter.close()
        ray_cluster.get(worker[0].set_fault.remote(0, None))


def test_a_failure_inside_the_adapter_costs_its_rounds_only_and_is_logged_once(engine, reference, caplog):
    check = Checked(engine, reference)
    engine.start(10, max_new=100)
    engine.start(17, max_new=100)
    for _ in range(2):
        engine.iterate(accept=1, check=check)
    pool = engine.drafter.pool
    real, left = pool.step_end, [2]

    def failing_step_end(pending):
        results = real(pending)                     # read, so the connection stays in step
        if left[0]:
            left[0] -= 1
            raise RuntimeError("injected")
        return results

    pool.step_end = failing_step_end
    with caplog.at_level(logging.ERROR, logger="dspark_ray.engines.exllamav3"):
        failed = [engine.iterate(accept=1, check=check) for _ in range(2)]
    assert [r.confidence_len for r in failed] == [0, 0]              # no drafts: verified without them
    assert check.codes[-2:] == [[None, None], [None, None]]
    assert engine.drafter.stats["failures"] == 2
    assert sum("forward failed" in r.getMessage() for r in caplog.records) == 1
    engine.iterate(accept=1, check=check)
    assert check.codes[-1] == [Code.OK] * 2                          # the next round re-inserted and drafted


def test_a_sequence_without_a_free_slot_drafts_nothing_until_one_is_given_back(engine, reference, worker,
                                                                             ray_cluster):
    check = Checked(engine, reference)
    jobs = [engine.start(6 + k, max_new=100) for k in range(SLOTS + 1)]
    for _ in range(3):
        engine.iterate(accept=1, check=check)
        assert check.codes[-1].count(Code.OK) == SLOTS and check.codes[-1][-1] is None   # the last row waits ...
    assert engine.drafter.stats["acquire_refused"] == 1             # ... without asking again every round
    engine.cancel(jobs[0])
    engine.iterate(accept=2, check=check)
    assert check.codes[-1] == [Code.OK] * SLOTS                    # the freed slot went to the waiting sequence
    assert held(worker, ray_cluster) == SLOTS


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
