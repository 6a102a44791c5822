"""Measurement at the seams (observe/seams.py): a recorder installed from outside stamps a batch's way through the
front-end's ring, the rank's ring loop, its engine and its graph set under the names the benches read, and a party
built without one runs its own objects, unwrapped."""
from __future__ import annotations

import threading
import types

from dspark_ray.frontend.ring_driver import RingDriver
from dspark_ray.observe.observers import DriverObserver, RankObserver
from dspark_ray.observe.recorders import DriverRecorder, RankRecorder
from dspark_ray.observe.stamps import HOPS
from dspark_ray.protocol import records as M
from dspark_ray.rank.engine import RankEngine
from dspark_ray.rank.modes import make_drafter
from dspark_ray.rank.worker import RankWorker
from dspark_ray.testing import workload
from dspark_ray.testing.batches import Batcher, entry
from dspark_ray.transport.ring import StepRing

import torch

RANK_STAMPS = {"seq", "got", "cpu_got", "engine_in", "cpu_engine_in", "started", "run_in", "writable",
               "first_launch", "insert_launched", "draft_staged", "launched", "synced", "ran", "engine_out",
               "cpu_engine_out", "encoded", "cpu_encoded"}
RING_STAMPS = {"publish", "posting", "seq", "completions", "cpu_completions"}


def _rank(reader, engine, rec) -> RankWorker:
    """A rank as `serve` leaves it (the ring and the engine through the recorder's seams), without loading."""
    w = RankWorker.__new__(RankWorker)
    w.spec, w.rank, w.observer = types.SimpleNamespace(spin_us=0.0, rank_cpus=None), 0, rec
    w.engine, w._later, w._stop = engine, None, False
    rec.seam_engine(engine)
    w.reader = rec.seam_ring(reader)
    return w


def test_a_batch_is_stamped_at_each_seam_under_the_names_the_benches_read(cfg, ckpt):
    rank_rec = RankRecorder(0, 0.0)
    engine = RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), 4, graphs=True, observer=rank_rec)
    ring = StepRing.create("dsr-seams-test", n_readers=1, slot_bytes=1 << 20)
    try:
        failed = []
        driver = RingDriver(ring, 30.0, on_fail=lambda: failed.append(1))
        ring_rec = DriverRecorder()
        ring_rec.seam(driver)
        worker = _rank(StepRing.attach(ring.handle, 0), engine, rank_rec)
        t = threading.Thread(target=worker._loop, daemon=True)
        t.start()
        place = Batcher(engine.slots)
        taps = workload.make_taps(cfg, 3, torch.Generator().manual_seed(2)).numpy()
        first = driver.run(place([entry(slot=0, seed_token=5, n_out=3, token_ids=[1, 2, 3], taps=taps)]))
        second = driver.run(place([entry(slot=0, seed_token=7, n_out=2)]))
        resets_only = driver.run(place([], resets=[1]))
        ring.close()
        t.join(10)
        assert not t.is_alive() and not failed
        worker.reader.close()
    finally:
        ring.unlink()
    assert len(first[0].drafts) == 4 * 3 and len(second[0].drafts) == 4 * 2 and resets_only == []
    rows, ring_rows = rank_rec.stamps.recent(), ring_rec.stamps.recent()
    assert [r["seq"] for r in rows] == [r["seq"] for r in ring_rows] == [1, 2, 3]
    assert set(rows[0]) == RANK_STAMPS
    assert set(rows[1]) == RANK_STAMPS - {"insert_launched"}          # no rows: the draft alone
    assert set(rows[2]) == {"seq", "got", "cpu_got", "engine_in", "cpu_engine_in", "started", "ran", "engine_out",
                            "cpu_engine_out", "encoded", "cpu_encoded"}      # resets alone: no graph set's
    assert all(set(r) == RING_STAMPS for r in ring_rows)
    for r in rows:                # every rank hop of stamps.py a row has reads forwards
        for _, a, b in HOPS:
            if a.startswith("rank_") and b.startswith("rank_") and a[5:] in r and b[5:] in r:
                assert r[a[5:]] <= r[b[5:]], (a, b)
    g, r = ring_rows[0], rows[0]
    assert g["publish"] <= g["posting"] <= r["got"] <= r["encoded"] <= g["completions"]
    assert rank_rec.batch is None and rank_rec.results is None     # nothing of the ring's slot is held


def test_without_a_recorder_nothing_is_wrapped(cfg, ckpt):
    engine = RankEngine(make_drafter(cfg, "tp1", ckpt=ckpt), 2)
    RankObserver().seam_engine(engine)
    assert not {"_step", "reset_slots", "_run"} & set(vars(engine))
    reader = object()
    assert RankObserver().seam_ring(reader) is reader
    driver = RingDriver(types.SimpleNamespace(), 1.0, on_fail=lambda: None)
    DriverObserver().seam(driver)
    assert "run" not in vars(driver) and type(driver.ring) is types.SimpleNamespace


def test_a_failed_step_is_recorded_without_its_results_and_a_failed_batch_not_at_all():
    rec = DriverRecorder()
    ring = types.SimpleNamespace(publish=lambda payload, timeout_s: 4,
                                 wait_completions=lambda seq, timeout_s, spin_us, idle: [(0, b"x"), (1, b"y")])
    driver = types.SimpleNamespace(ring=ring, run=lambda batch, deadline_ns=None: None)
    rec.seam(driver)
    driver.run("batch")
    assert driver.ring.publish(b"abc", timeout_s=1.0) == 4
    driver.ring.wait_completions(4, timeout_s=1.0)
    assert rec.stamps.recent() == [] and rec.row["seq"] == 4 and set(rec.row) == {"publish", "posting", "seq"}

    rank = RankRecorder(0, 0.0)
    seen = []
    rank.answered = lambda batch, results, size: seen.append((batch, results, size))
    inner = types.SimpleNamespace(sleeps=0, next=lambda timeout_s, spin_us, idle: (1, memoryview(b"12345")),
                                  complete=lambda seq, status, payload: None)
    reader = rank.seam_ring(inner)
    reader.next(timeout_s=1.0, spin_us=0.0)
    rank.batch, rank.results = "batch", ["r"]          # as the engine's seam left them
    reader.complete(1, M.STATUS_STEP_FAILED, b"")
    assert seen == [("batch", None, 5)] and [r["seq"] for r in rank.stamps.recent()] == [1]
