"""`RemoteDrafter`: exllamav3 1.6.5's DSpark drafter interface, answered by a dspark-ray deployment (docs/exllamav3.md).

The round's STEP leaves when verification ends: `update_kv_from_target` is handed the accepted rows, and by then
each row's next seed is sampled, so the adapter sends the entries there and `forward` only reads the answers. Rows
the early STEP could not cover (a job whose prefill just ended, a row whose sequence changed) go in a second STEP
from `forward`. No exception of the adapter's reaches the generator: a round it cannot serve drafts nothing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Sequence

import numpy as np
import torch

from ...client.drafter_client import ClientError, RequestSlot
from ...protocol.contract import Code, Entry, EntryResult, error_result
from ...client.pool import DrafterPool, PoolPendingStep
from .draft_cache import DraftCache
from .generator_rows import GeneratorRows, Row, token_ids
from .prefix_windows import PAGE_SIZE, PrefixKeys, PrefixWindows
from .row_window import RowWindow

log = logging.getLogger("dspark_ray.engines.exllamav3")

ACQUIRE_RETRY_ROUNDS = 16    # after a refused ACQUIRE (sooner when a slot of ours frees)
PREFIX_WINDOWS = 64          # page boundaries remembered at most (full width: 3.9 MB each)


@dataclass(eq=False)
class _Sequence:
    """What the adapter keeps of one of the generator's sequences."""
    source: object               # the generator's Sequence (its identity names the row)
    window: RowWindow
    keys: PrefixKeys
    slot: RequestSlot | None = None


@dataclass
class _Drafts:
    ids: torch.Tensor
    confidence_len: int


@dataclass
class _Copy:
    """A verification's accepted rows on their way to the host (the blocking path lands them at the next call)."""
    event: object
    host: torch.Tensor           # rows' taps from position offset `lo` of the handed window
    lo: int
    rows: list = field(default_factory=list)     # (sequence state, row, first kept position, accepted, kept ids)


@dataclass
class _EarlyStep:
    """The STEP sent at verification: per entry, the sequence, the position its seed sits at, and the seed."""
    pending: PoolPendingStep
    rows: list[tuple[_Sequence, int, int]]


class RemoteDrafter:
    """A row answered other than OK drafts nothing that round, so the output is the trunk's either way."""

    def __init__(self, endpoints: Sequence[str] | str | DrafterPool, config, *, deadline_ms: float = 20.0,
                 timeout_s: float = 1.0, spin_us: float = 0.0, tp: int | None = None,
                 config_digest: str | None = None, margins: bool = False, early: bool = True,
                 prefix_windows: int = PREFIX_WINDOWS, token: str | None = None):
        """`endpoints`: "host:port" (a list, or commas) or a `DrafterPool`. `config`: exllamav3's `Config` (or a
        `DrafterConfig`), checked against what the service serves. `deadline_ms`: each STEP's budget; `timeout_s`:
        after it a silent worker is marked down; `spin_us`: polling before blocking. `config_digest` / `tp`: pin the
        served drafter. `margins`: also keep each draft's top-1 minus top-2 logit (`last_margins`). `early`: send
        the STEP when verification ends (False: from `forward`, blocking). `prefix_windows`: page boundaries whose
        last window is kept for prompts that start on the prefix cache. `token`: the deployment's access token, sent
        in every HELLO (docs/operations.md, "Security")."""
        self.pool = endpoints if isinstance(endpoints, DrafterPool) else \
            DrafterPool(endpoints, timeout_s=timeout_s, spin_us=spin_us, token=token)
        if self.pool.hello_reply is None:
            self.pool.hello(config_digest=config_digest, tp=tp, client="dspark-ray exllamav3 adapter")
        lim = self.limits = self.pool.limits
        B = int(config.dspark_block_size)
        layers = sorted(int(i) for i in config.dspark_target_layer_ids)
        served = {"hidden_size": lim.hidden_size, "vocab_size": lim.vocab_size, "taps": lim.n_taps}
        ours = {"hidden_size": int(config.hidden_size), "vocab_size": int(config.vocab_size),
                "taps": max(len(layers), 1)}
        for k in served:
            if served[k] != ours[k]:
                raise ClientError(f"the service drafts for {k} {served[k]}, the model has {ours[k]}",
                                  Code.CONFIG_MISMATCH)
        if B > lim.max_n_out:
            raise ClientError(f"the model drafts {B} tokens a block, the service at most {lim.max_n_out}",
                              Code.CONFIG_MISMATCH)
        self.block_size, self.deadline_ms, self.margins, self.early = B, deadline_ms, margins, early
        # What the generator reads of a drafter: block_size counts the seed position (generator/generator.py).
        self.config = SimpleNamespace(block_size=B + 1, dspark_block_size=B, dspark_target_layer_ids=layers,
                                      hidden_size=lim.hidden_size, vocab_size=lim.vocab_size)
        self.caps = {"dflash_draft": True, "default_draft_size": B, "supports_tp": False,
                     "recurrent_states": False, "mtp_draft": False, "attach_target": False}
        self.draft_verifier_params = {"export_state_layers": set(layers)}
        self._rows: GeneratorRows | None = None
        self._width = lim.taps_width
        self._keep = lim.sliding_window + lim.max_rows_per_entry      # a re-insert window plus one insert
        self._seqs: dict[int, _Sequence] = {}                          # by id() of the generator's sequence
        self._prefixes = PrefixWindows(prefix_windows, lim.sliding_window)
        self._copies: list[_Copy] = []
        self._early: _EarlyStep | None = None
        self._pinned: torch.Tensor | None = None
        self._acquire_after = 0
        self._logged: set[str] = set()
        self.stats = {"rounds": 0, "rows": 0, "ok": 0, "not_ok": {}, "released": 0, "acquire_refused": 0,
                      "partial_windows": 0, "unknown_rows": 0, "unmatched_rows": 0, "prefix_hits": 0,
                      "early_entries": 0, "early_used": 0, "second_steps": 0, "failures": 0}
        self.last_codes: list[Code | None] = []     # per row (None: no entry was sent)
        self.last_margins: list[np.ndarray | None] = []

    def cache_for(self, cache) -> DraftCache:
        return DraftCache(cache, self.forget_all)

    def bind(self, generator) -> "RemoteDrafter":
        """Read which sequence each row is, its token ids and its seed from `generator`'s jobs (the calls name rows
        by cache pages only; the contract carries token ids)."""
        if getattr(generator, "draft_model", None) is not self:
            raise ValueError("bind: the generator was not built with this drafter as its draft_model")
        if getattr(generator, "cpu_page_cache", None) is not None:
            raise ValueError("the remote drafter holds no draft-cache pages: build the Generator with "
                             "cpu_cache_size=0 (its CPU / disk page tiers would copy them)")
        self._rows = GeneratorRows(generator)
        return self

    def attach_to(self, target) -> None:
        """Nothing to borrow: the service holds the trunk's embedding and head."""

    def close(self) -> None:
        self.forget_all()
        self.pool.close()

    def forget_all(self) -> None:
        """Every slot given back and every sequence forgotten (the generator's pages are about to move)."""
        self._contained("forget_all", self._forget_all)

    # ---- the generator's calls: never an exception into it ---------------------------------------------------
    @torch.inference_mode()
    def update_kv_from_target(self, target_hidden: list, cache, params: dict, lengths: list[int] | None = None):
        """Keep the rows the trunk accepted (`lengths` None: a prefill chunk); after a verification, send the STEP
        for every row that goes on drafting."""
        self._contained("update_kv_from_target", self._update, target_hidden, params, lengths)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, params: dict, **kwargs) -> _Drafts:
        """The round's drafts: row i's answer to the early STEP, or to one sent now with its seed `input_ids[i, -1]`."""
        seeds = input_ids[:, -1].tolist()
        out = torch.tensor(seeds, dtype=torch.long).unsqueeze(1).repeat(1, self.block_size + 1)   # the seed: none
        self.last_codes, self.last_margins = [None] * len(seeds), [None] * len(seeds)
        drafted = self._contained("forward", self._forward, out, seeds, params)
        return _Drafts(out, drafted or 0)

    def sample_from_state(self, state: _Drafts, params: dict) -> torch.Tensor:
        """(rows, block_size + 1) host ids, column 0 the seed; sets `params["draft_confidence_len"]` (0: no drafts)."""
        params["draft_confidence_len"] = state.confidence_len
        return state.ids

    def _contained(self, where: str, fn, *args):
        """Run `fn`; a failure costs this round its drafts, is counted and logged once, and every slot is given back
        so the next round re-inserts each sequence's last window."""
        try:
            return fn(*args)
        except Exception as e:
            self.stats["failures"] += 1
            self._log_once(f"{where}:{type(e).__name__}", logging.ERROR,
                           "exllamav3 adapter: %s failed (%s: %s); this round drafts nothing, the next re-inserts",
                           where, type(e).__name__, e, exc_info=True)
            try:
                self._copies.clear()
                self._settle()
                self._give_back([s for s in self._seqs.values() if s.slot is not None])
            except Exception as again:
                self._log_once(f"recover:{type(again).__name__}", logging.ERROR,
                               "exllamav3 adapter: recovery after %s failed too: %s", where, again)
            return None

    def _log_once(self, key: str, level: int, msg: str, *args, **kw) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args, **kw)

    # ---- rows in ---------------------------------------------------------------------------------------------
    def _update(self, target_hidden: list, params: dict, lengths: list[int] | None) -> None:
        self._land()
        rows_of = self._need_rows()
        block_table, starts = params["block_table"], _host_list(params["cache_seqlens"])
        if lengths is None:                                  # a prefill chunk: one sequence, its own block row
            row = rows_of.prefilling(block_table)
            if row is None:
                self._unmatched(1)
            else:
                self._take_prefill(self._sequence(row, starts[0]), starts[0], target_hidden)
            return
        rows = rows_of.batch(block_table, [s + n for s, n in zip(starts, lengths)])
        kept = []                           # (sequence, batch row, first kept position, accepted, kept ids)
        for i, (row, start, n) in enumerate(zip(rows, starts, lengths)):
            if row is None:
                self._unmatched(1)
            elif n:
                keep = min(n, self._keep)
                kept.append((self._sequence(row, start), i, start + n - keep, n, row.ids(start + n - keep, start + n)))
        if not kept:
            return
        lo = min(n - len(ids) for *_, n, ids in kept)
        hi = max(n for *_, n, _ in kept)
        taps = torch.cat([t[:, lo:hi] for t in target_hidden], dim=-1)      # (rows, hi - lo, n_taps * hidden)
        if self.early or not taps.is_cuda:
            self._land_copy(_Copy(None, taps.cpu(), lo, kept))
        else:                                               # ordered on the stream, waited for at the next call
            host = self._pinned_for(taps.shape)
            host.copy_(taps, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copies.append(_Copy(event, host, lo, kept))
        if self.early:
            self._send_early([(seq, rows[i]) for seq, i, *_ in kept])

    def _take_prefill(self, seq: _Sequence, s0: int, target_hidden: list) -> None:
        """A prefill chunk's rows: its last ones into the window, and the window before each page boundary in it;
        only those rows are copied to the host, in one gather."""
        n = target_hidden[0].shape[1]
        end = s0 + n
        tail = end - min(n, self._keep)
        W = self.limits.sliding_window
        spans = [(max(b - W, s0), b) for b in self._prefixes.boundaries(s0, end)] + [(tail, end)]
        pos = np.unique(np.concatenate([np.arange(a, b) for a, b in spans]))
        index = torch.from_numpy(pos - s0).to(target_hidden[0].device)
        taps = torch.cat([t[0].index_select(0, index) for t in target_hidden], dim=-1).cpu().numpy()
        ids = token_ids(seq.source, s0, end)[pos - s0]

        def rows(a: int, b: int):                          # positions [a, b), all gathered
            i = int(np.searchsorted(pos, a))
            return ids[i:i + b - a], taps[i:i + b - a]

        self._keep_windows(seq, s0, end, rows)
        seq.window.append(tail, *rows(tail, end))

    def _append(self, seq: _Sequence, start: int, ids: np.ndarray, taps: np.ndarray) -> None:
        """A verification's accepted rows from `start` into the sequence's window."""
        self._keep_windows(seq, start, start + len(ids), lambda a, b: (ids[a - start:b - start],
                                                                       taps[a - start:b - start]))
        seq.window.append(start, ids, taps)

    def _keep_windows(self, seq: _Sequence, start: int, end: int, new_rows) -> None:
        """The window before each page boundary in (start, end], from the sequence's window (positions before
        `start`) and `new_rows(a, b)` (from `start` on), for prompts that start there later."""
        W = self.limits.sliding_window
        for b in self._prefixes.boundaries(start, end):
            parts = [new_rows(max(b - W, start), b)]
            if b - W < start:
                before = seq.window.rows(b - W, start) if seq.window.end == start else None
                if before is None:
                    continue
                parts.insert(0, before)
            self._prefixes.put(seq.keys.at_boundary(b), np.concatenate([p[0] for p in parts]),
                               np.concatenate([p[1] for p in parts]))

    def _sequence(self, row: Row, at: int) -> _Sequence:
        """The adapter's state of `row`'s sequence, its window ending at `at` (a sequence that rows never reached
        there: seeded from the prefix windows, else empty)."""
        seq = self._seqs.get(id(row.seq))
        fresh = seq is None or seq.source is not row.seq
        if fresh:
            if seq is not None:                             # an ended sequence's id, reused
                self._give_back([seq] if seq.slot is not None else [])
            seq = self._seqs[id(row.seq)] = _Sequence(row.seq, RowWindow(self._width, self._keep, at),
                                                      PrefixKeys(lambda a, b, s=row.seq: token_ids(s, a, b)))
        if fresh or seq.window.end != at:
            seq.window.restart(at)
            seq.keys.reset()
            found = self._prefixes.get(seq.keys.at_boundary(at)) if at and at % PAGE_SIZE == 0 else None
            if found is not None:
                seq.window.append(at - len(found[0]), *found)
                self.stats["prefix_hits"] += 1
            elif at > 0:
                self.stats["partial_windows"] += 1
        return seq

    def _land(self) -> None:
        copies, self._copies = self._copies, []
        for c in copies:
            c.event.synchronize()
            self._land_copy(c)

    def _land_copy(self, c: _Copy) -> None:
        taps = c.host.numpy()
        for seq, i, a, n, ids in c.rows:
            self._append(seq, a, ids, taps[i, n - len(ids) - c.lo:n - c.lo])

    # ---- the early STEP --------------------------------------------------------------------------------------
    def _send_early(self, rows: list[tuple[_Sequence, Row]]) -> None:
        """The STEP for every verified row that drafts next round, its seed the token it just sampled."""
        self._settle()                                        # a round without a draft call left one unread
        ended = [s for s, r in rows if r.ended]
        for s in ended:
            self._seqs.pop(id(s.source), None)
        self._give_back([s for s in ended if s.slot is not None])
        entries, sent = [], []
        for seq, row in rows:
            end = seq.window.end
            if row.ended or seq.slot is None or end != row.seq.kv_position or (not seq.window.n and end > 0):
                continue
            seed = int(row.ids(end, end + 1)[0])
            entry = self._entry(seq, seed)
            if entry is not None:
                entries.append(entry)
                sent.append((seq, end, seed))
        if entries:
            self._early = _EarlyStep(self.pool.step_begin(entries, deadline_ms=self.deadline_ms), sent)
            self.stats["early_entries"] += len(entries)

    def _settle(self) -> dict[int, tuple[int, int, EntryResult]]:
        """Read the early STEP's answers into its slots; by sequence: (position, seed, answer)."""
        early, self._early = self._early, None
        if early is None:
            return {}
        results = self.pool.step_end(early.pending)
        out = {}
        for (seq, end, seed), r in zip(early.rows, results):
            if seq.slot is not None:
                seq.slot.answer(r)
                self._after_answer(seq, r)
            out[id(seq)] = (end, seed, r)
        return out

    # ---- drafts out ------------------------------------------------------------------------------------------
    def _forward(self, out: torch.Tensor, seeds: list[int], params: dict) -> int:
        self._land()
        rows_of = self._need_rows()
        kv = _host_list(params["cache_seqlens"])
        early = self._settle()
        rows = rows_of.batch(params["block_table"], kv)
        batch: list[_Sequence | None] = []
        for i, row in enumerate(rows):
            if row is None:
                self._unmatched(1)
                batch.append(None)
                continue
            seq = self._sequence(row, kv[i])
            if not seq.window.n and kv[i] > 0:                 # rows this drafter never saw (nor their prefix)
                self.stats["unknown_rows"] += 1
            batch.append(seq)
        answers: dict[int, EntryResult] = {}
        for i, seq in enumerate(batch):
            got = early.get(id(seq)) if seq is not None else None
            if got is not None and got[:2] == (kv[i], seeds[i]):
                answers[i] = got[2]
                self.stats["early_used"] += 1
        self._release_ended(rows_of)
        self._grant_slots([s for s in batch if s is not None])
        entries, where = [], []
        for i, seq in enumerate(batch):
            if i in answers or seq is None or seq.slot is None or seq.window.end != kv[i] or \
                    (not seq.window.n and kv[i] > 0):
                continue                                       # answered early, or no slot / rows: no drafts
            entry = self._entry(seq, seeds[i])
            if entry is not None:
                entries.append(entry)
                where.append(i)
        if entries:
            self.stats["second_steps"] += 1
            for i, r in zip(where, self._step(entries)):
                batch[i].slot.answer(r)
                self._after_answer(batch[i], r)
                answers[i] = r
        conf = 0
        for i, r in answers.items():
            self.last_codes[i] = Code(r.code)
            if r.code == Code.OK:
                out[i, 1:] = torch.from_numpy(r.drafts_array().astype(np.int64))
                if self.margins:
                    self.last_margins[i] = r.margins_array().copy()
                conf = max(conf, r.confident_len)
                self.stats["ok"] += 1
            else:
                name = Code(r.code).name
                self.stats["not_ok"][name] = self.stats["not_ok"].get(name, 0) + 1
        self.stats["rounds"] += 1
        self.stats["rows"] += len(batch)
        return conf

    def _entry(self, seq: _Sequence, seed: int) -> Entry | None:
        w = seq.window
        try:
            return seq.slot.entry(w.ids, w.taps, seed, first=w.first)
        except ClientError as e:                               # a swap for a fresh slot found none free
            log.debug("slot swap failed: %s", e)
            seq.slot = None
            return None

    def _after_answer(self, seq: _Sequence, r: EntryResult) -> None:
        """A slot lost with its worker is replaced next round; one the service refused an entry for (our bug, or a
        position it disowns) is given back, so a fresh slot takes the last window."""
        if r.code == Code.UNAVAILABLE and self.pool.worker_of(seq.slot.grant.slot) is None:
            seq.slot = None
        elif r.code == Code.BAD_ENTRY:
            self._log_once("bad_entry", logging.ERROR, "exllamav3 adapter: the service refused an entry: %s",
                           r.reason)
            self._give_back([seq])

    def _step(self, entries: list[Entry]) -> list[EntryResult]:
        try:
            return self.pool.step(entries, deadline_ms=self.deadline_ms)
        except ClientError as e:
            return [error_result(e.code or Code.UNAVAILABLE, str(e), en.generation) for en in entries]

    # ---- slots -----------------------------------------------------------------------------------------------
    def _release_ended(self, rows_of: GeneratorRows) -> None:
        live = rows_of.live()
        ended = [s for k, s in self._seqs.items() if k not in live]
        for s in ended:
            self._seqs.pop(id(s.source), None)
        self._give_back([s for s in ended if s.slot is not None])

    def _give_back(self, seqs: list[_Sequence]) -> None:
        slots = [s.slot.grant.slot for s in seqs if s.slot is not None]
        for s in seqs:
            s.slot = None
        if not slots:
            return
        self._settle()
        self._acquire_after = 0
        try:
            self.pool.release(slots)
            self.stats["released"] += len(slots)
        except ClientError as e:      # its worker is gone: so is the slot
            log.warning("release of %d slots failed: %s", len(slots), e)

    def _grant_slots(self, batch: list[_Sequence]) -> None:
        """A slot for each sequence without one, as many as are free; the rest wait."""
        need = [s for s in batch if s.slot is None]
        if not need or self.stats["rounds"] < self._acquire_after:
            return
        try:
            grants = self.pool.acquire(len(need))
        except ClientError as e:
            grants = []
            for _ in need:                           # all or nothing above: as many as there are, one at a time
                try:
                    grants += self.pool.acquire(1)
                except ClientError:
                    break
            if len(grants) < len(need):
                self.stats["acquire_refused"] += 1
                self._acquire_after = self.stats["rounds"] + ACQUIRE_RETRY_ROUNDS
                log.debug("%d of %d sequences wait for a slot: %s", len(need) - len(grants), len(need), e)
        for s, g in zip(need, grants):
            s.slot = RequestSlot(self.pool, self.block_size, self.deadline_ms, grant=g, want_margins=self.margins)

    def _forget_all(self) -> None:
        self._copies.clear()
        self._settle()
        seqs = list(self._seqs.values())
        self._seqs.clear()
        self._give_back(seqs)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _need_rows(self) -> GeneratorRows:
        if self._rows is None:
            raise RuntimeError("the drafter reads rows from the generator: call bind(generator) after building it")
        return self._rows

    def _unmatched(self, n: int) -> None:
        self.stats["unmatched_rows"] += n
        self._log_once("unmatched", logging.WARNING, "exllamav3 adapter: a row of the generator's batch does not "
                       "match its active jobs: that row drafts nothing (stats['unmatched_rows'] counts them)")

    def _pinned_for(self, shape) -> torch.Tensor:
        n = int(np.prod(shape))
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 1 << 16), dtype=torch.float16, pin_memory=True)
        return self._pinned[:n].view(shape)


def _host_list(x) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]

