"""bench/restart.py: its client re-inserts what a slot lacks as the contract says, its check tells a changed bit,
and on a tiny pair a rank killed with SIGKILL mid-load gives OK answers again, each the bits a fresh deployment
answers to the same entries."""
from __future__ import annotations

import numpy as np

from bench.restart import Request, differs, measure
from support import workload
from dspark_ray.contract import Code, EntryResult


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
    # answered something else first (the in-flight STEP's INTERNAL, UNAVAILABLE while restarting), then OK
    errors = [v for c, v in k["to_first"].items() if c != "OK"]
    assert errors and max(errors) <= k["to_first"]["OK"] == k["to_first_ok_s"]
    cr = out["correctness"]
    assert cr["ok_answers_checked_after_a_kill"] >= 4 * 2 and cr["reference_not_ok"] == 0
    assert cr["wrong_drafts"] == 0 and cr["wrong_other_fields"] == 0, cr["first_wrong"]
