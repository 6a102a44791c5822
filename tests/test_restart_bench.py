"""bench/restart.py: its client re-inserts what a slot lacks as the contract says, its check tells a changed bit,
and on a tiny pair a rank killed with SIGKILL mid-load gives OK answers again, each the bits a fresh deployment
answers to the same entries."""
from __future__ import annotations

import numpy as np

from bench.restart import Request, differs, measure
from dspark_ray.testing import workload
from dspark_ray.protocol.contract import Code, EntryResult


def _tokens(entry) -> list[int]:
    return np.frombuffer(entry.token_ids, np.int32).tolist()


def test_the_client_sends_what_the_slot_lacks(cfg):
    W = cfg.sliding_window
    work = workload.stream(cfg, seed=3, n_requests=1, rollback_every=0)
    q = Request(W, 128)
    q.assign(0, 1)
    context: list[int] = []
    for _ in range(6):                                    # served: each round's rows alone
        (e,) = next(work)
        q.advance(e)
        context += _tokens(e)
        sent = q.entry()
        assert sent.start_pos == len(context) - e.rows and _tokens(sent) == _tokens(e)
        q.settle(EntryResult(code=Code.OK, generation=1))
    (e,) = next(work)                                     # UNAVAILABLE: the slot is unchanged ...
    q.advance(e)
    context += _tokens(e)
    q.entry()
    q.settle(EntryResult(code=Code.UNAVAILABLE, generation=1))
    (e,) = next(work)                                     # ... so the next entry carries both rounds' rows
    q.advance(e)
    context += _tokens(e)
    sent = q.entry()
    assert _tokens(sent) == context[sent.start_pos:] and len(context) - sent.start_pos > e.rows
    q.settle(EntryResult(code=Code.STALE_GENERATION, generation=2))      # resynced: the last window, fresh
    (e,) = next(work)
    q.advance(e)
    context += _tokens(e)
    sent = q.entry()
    assert (sent.generation, sent.start_pos, sent.rollback_to) == (2, len(context) - W, -1)
    assert _tokens(sent) == context[-W:]
    q.settle(EntryResult(code=Code.OK, generation=2))
    e = next(work)[0]                                     # the trunk rolls back below what the slot holds
    e.rollback_to, e.start_pos = len(context) - 1, len(context) - 1
    context = context[:-1]
    q.advance(e)
    context += _tokens(e)
    sent = q.entry()
    assert sent.rollback_to == sent.start_pos == len(context) - e.rows
    assert _tokens(sent) == _tokens(e)


def test_the_check_tells_one_changed_bit():
    a = EntryResult(drafts=np.array([5, 7], np.int32).tobytes(), confidences=np.array([0.5, 0.25], np.float32)
                    .tobytes(), confident_len=1)
    assert differs(a, EntryResult(**{f: getattr(a, f) for f in a.__struct_fields__})) is None
    flipped = bytearray(a.confidences)
    flipped[0] ^= 1
    assert differs(EntryResult(drafts=a.drafts, confidences=bytes(flipped), confident_len=1), a) == "confidences"
    assert differs(EntryResult(drafts=a.drafts[::-1], confidences=a.confidences, confident_len=1), a) == "drafts"


def test_a_killed_rank_serves_again_with_the_bits_of_a_fresh_deployment(ray_cluster, tiny_ckpt):
    from dspark_ray.spec import PairSpec
    spec = PairSpec(checkpoint=str(tiny_ckpt), tp=2, n_slots=4, max_batch=4)
    out = measure(spec, name="restart-test", requests=2, rounds=4, kills=1, kill_rank=1, gap_ms=5)
    (k,) = out["kills_detail"]
    assert out["recovered"] == 1 and k["supervisor_restarts"] == 1 and k["old_pid_gone"]
    # answered something else first (the in-flight STEP's INTERNAL, UNAVAILABLE while restarting), then OK to a
    # STEP sent after the kill (the STEP in flight may still have been answered OK: the kill came after its work)
    errors = [v for c, v in k["to_first"].items() if c != "OK"]
    assert errors and max(errors) <= k["to_first_ok_s"]
    cr = out["correctness"]
    assert cr["ok_answers_checked_after_a_kill"] >= 4 * 2 and cr["reference_not_ok"] == 0
    assert cr["wrong_drafts"] == 0 and cr["wrong_other_fields"] == 0, cr["first_wrong"]


def test_a_one_card_restart_is_laid_out_phase_by_phase_and_a_kill_during_it_recovers(ray_cluster, tiny_ckpt, cfg):
    """tp 1, as the H200 figure: each kill's restart in phases from real stamps (the supervisor's, the front-end's,
    the new rank's own) that add up to its time to the first OK answer; the new rank served before it had made its
    Markov rows and captured every graph (the last batches' first, the rest, on the rows, between steps); a second
    kill while the rank restarts is a new failure the supervisor retries at once, and the worker serves again, every
    answer the bits of a fresh one (which made its rows and graphs before serving)."""
    from bench.restart import PHASES
    from dspark_ray.spec import PairSpec
    spec = PairSpec(checkpoint=str(tiny_ckpt), tp=1, n_slots=4, max_batch=4, markov_cache="all")
    # The second kill as soon as the new rank's process answers (second_kill_at 0), not at a share of the first
    # kill's restart time: the restart is under way then, however slow the host.
    out = measure(spec, name="restart-tp1", requests=2, rounds=4, kills=1, gap_ms=5, kills_during_restart=1,
                  second_kill_at=0)
    (k,) = out["kills_detail"]
    ph = k["phases_s"]
    want = [n for n, _ in PHASES if n not in ("cuda_context", "kernels")]     # (no CUDA, the exact matmul)
    assert list(ph) == want + ["total_s"], ph
    assert abs(sum(v for n, v in ph.items() if n != "total_s") - ph["total_s"]) < 0.01
    assert ph["total_s"] == k["to_first_ok_s"] and min(ph["weights"], ph["imports"], ph["graphs"]) > 0
    (g,) = k["graphs_at_first_ok"]
    assert g["count"] + g["pending"] == 2 * (4 * 5 * 2) + 5      # the whole set: 1-4 requests, n_out 1..5, margins
    assert 5 < g["captured_first"] < 2 * (4 * 5 * 2) + 5        # the inserts and the last batches' (2, ., .) only
    # the Markov rows made once serving, then every graph captured again on them, before the next kill
    later = k["after_first_ok"]
    assert not later["work_left"] and later["graphs"][0]["pending"] == 0, later
    assert ph["total_s"] < later["markov_rows_later_s"][1] <= later["graphs_later_s"][1] <= later["done_by_s"]
    assert later["markov_cache"][0]["rows"] == cfg.vocab_size and later["markov_cache"][0]["bytes"] > 0
    d = out["during_restart"]
    assert d["second_kills_landed"] == 1 and out["recovered"] == 2, d
    (k2,) = d["kills_detail"]
    assert k2["second_kill"]["after_s"] < k2["to_first_ok_s"] and k2["supervisor_restarts"] == 1
    cr = out["correctness"]
    assert cr["ok_answers_checked_after_a_kill"] >= 4 * 2 and cr["reference_not_ok"] == 0
    assert cr["wrong_drafts"] == 0 and cr["wrong_other_fields"] == 0, cr["first_wrong"]
