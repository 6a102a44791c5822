"""The README's client loop, run as written against a real front-end over TCP (`StepService` before an in-process
engine, as a rank runs it): a README whose client breaks fails CI. Its deadline too: the tiny drafter on this CPU
takes tens of ms a STEP, and the README's budget must fit it as it fits a GPU pair."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from dspark_ray.protocol import contract as C
from dspark_ray.client import DrafterClient
from dspark_ray.rank.engine import RankEngine
from dspark_ray.frontend.step_service import Identity, StepService
from dspark_ray.rank.modes import make_drafter
from dspark_ray.transport.tcp import TcpServer

from conftest import EnginePair

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_client_loop_drafts_every_round_and_releases_its_slot(cfg, ckpt):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    loop = next(b for b in blocks if "DrafterClient(" in b and "verify(" in b)
    width = cfg.n_taps * cfg.hidden_size
    rng = np.random.default_rng(0)
    svc = StepService(Identity("model", cfg.digest(), 2, cfg.max_model_len), C.Limits.for_config(cfg, slot_capacity=4),
                      EnginePair(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 4)),
                      window=cfg.sliding_window)
    token = "readme-" + "t" * 36
    srv = TcpServer(svc, token=token).start()
    rounds = []

    def prompt():
        n = 9
        return (np.arange(n, dtype=np.int64) + 3, (0.5 * rng.standard_normal((n, width))).astype(np.float16), 11)

    def verify(seed, drafts):
        rounds.append(len(drafts))
        accepted = [seed, *drafts[:1]]                  # the trunk keeps the seed and one draft
        taps = (0.5 * rng.standard_normal((len(accepted), width))).astype(np.float16)
        return np.asarray(accepted, dtype=np.int64), taps, (None if len(rounds) == 6 else 20 + len(rounds))

    try:
        exec(compile(loop, str(README), "exec"), {"PORT": srv.port, "TOKEN": token, "prompt": prompt,
                                                  "verify": verify})
        assert rounds == [5] * 6                        # every round answered OK with its 5 drafts
        assert svc.status()["slots"]["held"] == 0       # and the slot given back
    finally:
        srv.stop()


def test_a_request_slot_re_inserts_its_last_window_after_a_resync_and_swaps_a_slot_left_far_behind(cfg, ckpt):
    """`RequestSlot` sends only what its slot lacks; after a resync its next STEP answers as a fresh request given the
    same context does (the drafter reads only the last window), and a slot further behind than one insert is
    swapped for a fresh one, which answers OK at once."""
    width = cfg.n_taps * cfg.hidden_size
    rng = np.random.default_rng(1)
    svc = StepService(Identity("model", cfg.digest(), 2, cfg.max_model_len), C.Limits.for_config(cfg, slot_capacity=4),
                      EnginePair(RankEngine(make_drafter(cfg, "split", ckpt=ckpt), 4)), window=cfg.sliding_window)
    srv = TcpServer(svc).start()

    def rows(n):
        return rng.integers(0, cfg.vocab_size, n), (0.5 * rng.standard_normal((n, width))).astype(np.float16)

    try:
        with DrafterClient("127.0.0.1", srv.port, timeout_s=30) as c:
            lim = c.hello().limits
            ids, taps = rows(20)
            with c.request(deadline_ms=10_000) as req:
                assert req.step(ids, taps, 5).code == C.Code.OK and req.held == 20
                for _ in range(2):                      # each round sends its 3 new rows only
                    new = rows(3)
                    ids, taps = np.concatenate([ids, new[0]]), np.concatenate([taps, new[1]])
                    assert req.step(ids, taps, 7).code == C.Code.OK and req.held == len(ids)
                gen = req.grant.generation
                svc.resync_all()                        # a restart: every slot emptied, a new generation
                r = req.step(ids, taps, 9)
                assert r.code == C.Code.STALE_GENERATION and req.fresh and req.grant.generation == r.generation > gen
                r = req.step(ids, taps, 9)              # the last window, at its own positions
                assert r.code == C.Code.OK and req.held == len(ids)
                with c.request(deadline_ms=10_000) as ref:
                    want = ref.step(ids, taps, 9)
                    assert (want.code, want.drafts, want.confidences) == (r.code, r.drafts, r.confidences)
                gen = req.grant.generation
                new = rows(lim.max_rows_per_entry + 1)   # the trunk ran on while the drafter was away
                ids, taps = np.concatenate([ids, new[0]]), np.concatenate([taps, new[1]])
                r = req.step(ids, taps, 11)
                assert r.code == C.Code.OK and req.grant.generation > gen and req.held == len(ids)
            assert svc.status()["slots"]["held"] == 0
    finally:
        srv.stop()
