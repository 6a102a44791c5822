"""exllamav3 1.6.5's `Generator` drafting through dspark-ray in place of its DSpark drafter (docs/exllamav3.md):

    config = Config.from_directory(model_dir)
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=32768, max_history=config.dspark_block_size + 1)
    model.load()
    drafter = RemoteDrafter("10.0.0.5:7001", config)                       # HELLO: refuses another drafter
    generator = Generator(model, cache, Tokenizer.from_config(config),
                          draft_model=drafter, draft_cache=drafter.cache_for(cache))
    drafter.bind(generator)                                                 # where prompt rows get their ids
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Sequence

import numpy as np
import torch

from ..client import ClientError, RequestSlot
from ..contract import Code, EntryResult, error_result
from ..pool import DrafterPool

__all__ = ["RemoteDrafter"]

log = logging.getLogger("dspark_ray.engines.exllamav3")

PAGE_SIZE = 256          # exllamav3's cache page (generator/pagetable.py)
ACQUIRE_RETRY_ROUNDS = 16    # after a refused ACQUIRE (sooner when a slot of ours frees)

TokenSource = Callable[[torch.Tensor, int, int], np.ndarray]


class _Window:
    """A sequence's last rows (ids, taps) on the host, in 2 `keep` rows compacted once every `keep` rows."""

    def __init__(self, width: int, keep: int):
        self.keep = keep
        self._ids = np.empty(2 * keep, np.int32)
        self._taps = np.empty((2 * keep, width), np.float16)
        self.first = self.n = 0

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:self.n]

    @property
    def taps(self) -> np.ndarray:
        return self._taps[:self.n]

    @property
    def end(self) -> int:
        return self.first + self.n

    def append(self, start: int, ids: np.ndarray, taps: np.ndarray) -> None:
        if start != self.end:
            self.first, self.n = start, 0
        if len(ids) > self.keep:                     # only the last `keep` can ever be sent
            cut = len(ids) - self.keep
            ids, taps, start = ids[cut:], taps[cut:], start + cut
            self.first, self.n = start, 0
        k = len(ids)
        if self.n + k > len(self._ids):
            drop = self.n + k - self.keep
            self._ids[:self.n - drop] = self._ids[drop:self.n]
            self._taps[:self.n - drop] = self._taps[drop:self.n]
            self.first, self.n = self.first + drop, self.n - drop
        self._ids[self.n:self.n + k] = ids
        self._taps[self.n:self.n + k] = taps
        self.n += k


@dataclass
class _Sequence:
    window: _Window
    end: int                                     # one past its last row handed over (landed or on the way)
    page: int                                    # the physical cache page holding position `end`
    slot: RequestSlot | None = None
    drafted: bool = False


@dataclass
class _Drafts:
    ids: torch.Tensor
    confidence_len: int


@dataclass
class _Copy:
    event: object
    host: torch.Tensor                           # rows' taps from position offset `lo` of the handed window
    lo: int
    rows: list = field(default_factory=list)     # (batch row, sequence, first kept position, rows, kept ids)


class DraftCache:
    """Holds nothing (the state lives in the service); defragmentation's call for its tensors frees every slot."""

    def __init__(self, cache, drafter: "RemoteDrafter"):
        self.max_num_tokens = cache.max_num_tokens
        self.initialized = True
        self.max_history = 0
        self.model = SimpleNamespace(loaded_tp=False)
        self._drafter = drafter

    def get_all_tensors(self) -> list:
        self._drafter.forget_all()
        return []

    def copy_page(self, source, from_page: int, to_page: int, num_tokens: int) -> None:
        """Nothing to copy (exllamav3 copies partial pages only for trunks without recurrent state)."""


class RemoteDrafter:
    """exllamav3's DSpark drafter interface, answered by a dspark-ray deployment (one worker or several). A row
    answered other than OK drafts nothing that round, so the output is the trunk's either way."""

    def __init__(self, endpoints: Sequence[str] | str | DrafterPool, config, *, deadline_ms: float = 20.0,
                 timeout_s: float = 1.0, spin_us: float = 0.0, tp: int | None = None,
                 config_digest: str | None = None, tokens: TokenSource | None = None, margins: bool = False,
                 token: str | None = None):
        """`endpoints`: "host:port" (a list, or commas) or a `DrafterPool`. `config`: exllamav3's `Config` (or a
        `DrafterConfig`), checked against what the service serves. `deadline_ms`: each STEP's budget; `timeout_s`:
        after it a silent worker is marked down; `spin_us`: polling before blocking. `config_digest` / `tp`: pin the
        served drafter. `margins`: also keep each draft's top-1 minus top-2 logit (`last_margins`). `token`: the
        deployment's access token, sent in every HELLO (docs/operations.md, "Security")."""
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
        self.block_size, self.deadline_ms, self.margins = B, deadline_ms, margins
        # What the generator reads of a drafter: block_size counts the seed position (generator/generator.py).
        self.config = SimpleNamespace(block_size=B + 1, dspark_block_size=B, dspark_target_layer_ids=layers,
                                      hidden_size=lim.hidden_size, vocab_size=lim.vocab_size)
        self.caps = {"dflash_draft": True, "default_draft_size": B, "supports_tp": False,
                     "recurrent_states": False, "mtp_draft": False, "attach_target": False}
        self.draft_verifier_params = {"export_state_layers": set(layers)}
        self._tokens = tokens
        self._width = lim.taps_width
        self._keep = lim.sliding_window + lim.max_rows_per_entry      # a re-insert window plus one insert
        self._by_page: dict[int, _Sequence] = {}
        self._copies: list[_Copy] = []
        self._pinned: torch.Tensor | None = None
        self.stats = {"rounds": 0, "rows": 0, "ok": 0, "not_ok": {}, "released": 0, "acquire_refused": 0,
                      "partial_windows": 0, "unknown_rows": 0}
        self._acquire_after = 0
        self.last_codes: list[Code | None] = []     # per row (None: no entry was sent)
        self.last_margins: list[np.ndarray | None] = []

    def cache_for(self, cache) -> DraftCache:
        return DraftCache(cache, self)

    def bind(self, generator) -> "RemoteDrafter":
        """Read prompt rows' token ids from `generator`'s sequences (the contract carries them; the calls do not)."""
        if getattr(generator, "draft_model", None) is not self:
            raise ValueError("bind: the generator was not built with this drafter as its draft_model")
        if getattr(generator, "cpu_page_cache", None) is not None:
            raise ValueError("the remote drafter holds no draft-cache pages: build the Generator with "
                             "cpu_cache_size=0 (its CPU / disk page tiers would copy them)")
        self._tokens = _GeneratorTokens(generator)
        return self

    def attach_to(self, target) -> None:
        """Nothing to borrow: the service holds the trunk's embedding and head."""

    def close(self) -> None:
        self.forget_all()
        self.pool.close()

    @torch.inference_mode()
    def update_kv_from_target(self, target_hidden: list, cache, params: dict, lengths: list[int] | None = None):
        """Keep the rows the trunk accepted (`lengths` None: a prefill chunk), copied to host memory in one copy."""
        self._land()                    # a copy still pending (a round that did not draft) frees its buffer
        block_table, starts = params["block_table"], _host_list(params["cache_seqlens"])
        prefill = lengths is None
        if prefill:
            lengths = [target_hidden[0].shape[1]] * len(starts)
        rows, lo = [], None
        for i, (start, n) in enumerate(zip(starts, lengths)):
            if n == 0:
                continue
            seq = self._sequence_at(block_table[i], start, new=prefill and start == 0)
            if seq is None:            # after prefix-cached pages: the rows before it never came (a partial window)
                seq = self._sequence_at(block_table[i], start, new=True)
                self.stats["partial_windows"] += 1
            keep = min(n, self._keep)
            rows.append((i, seq, start + n - keep, n, self._token_ids(block_table[i], start + n - keep, keep)))
            lo = n - keep if lo is None else min(lo, n - keep)
            seq.end = start + n
            self._move(seq, int(block_table[i][seq.end // PAGE_SIZE]))
        if not rows:
            return
        hi = max(r[3] for r in rows)
        taps = torch.cat([t[:, lo:hi] for t in target_hidden], dim=-1)      # (rows, hi - lo, n_taps * hidden)
        if taps.is_cuda and not prefill:
            host = self._pinned_for(taps.shape)
            host.copy_(taps, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copies.append(_Copy(event, host, lo, rows))
        else:
            self._copies.append(_Copy(None, taps.cpu(), lo, rows))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, params: dict, **kwargs) -> _Drafts:
        """One STEP for the batch: row i's sequence, the rows its slot lacks and its seed `input_ids[i, -1]`."""
        self._land()
        block_table, kv = params["block_table"], _host_list(params["cache_seqlens"])
        seeds = input_ids[:, -1].tolist()
        batch = []
        for i, p in enumerate(kv):
            seq = self._sequence_at(block_table[i], p, new=False)
            if seq is None:            # a new sequence (a one-token prompt), or rows this drafter never saw
                self.stats["unknown_rows"] += p > 0
                seq = self._sequence_at(block_table[i], p, new=True)
            batch.append(seq)
        self._release_ended(batch)
        self._grant_slots(batch)
        B = self.block_size
        out = torch.tensor(seeds, dtype=torch.long).unsqueeze(1).repeat(1, B + 1)    # placeholders: the seed
        entries, where = [], []
        for i, seq in enumerate(batch):
            seq.drafted = True
            w = seq.window
            if seq.slot is None or w.end != kv[i] or (not len(w.ids) and kv[i] > 0):
                continue                              # no slot yet, or none of its rows: no drafts this round
            try:
                entries.append(seq.slot.entry(w.ids, w.taps, seeds[i], first=w.first))
                where.append(i)
            except ClientError as e:               # a swap for a fresh slot found none free
                log.debug("slot swap failed: %s", e)
                seq.slot = None
        results = self._step(entries)
        conf = 0
        self.last_codes = [None] * len(batch)
        self.last_margins = [None] * len(batch)
        for i, r in zip(where, results):
            seq = batch[i]
            seq.slot.answer(r)
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
                if r.code == Code.UNAVAILABLE and self.pool.worker_of(seq.slot.grant.slot) is None:
                    seq.slot = None                   # lost with its worker: a new one next round
        self.stats["rounds"] += 1
        self.stats["rows"] += len(batch)
        return _Drafts(out, conf)

    def sample_from_state(self, state: _Drafts, params: dict) -> torch.Tensor:
        """(rows, block_size + 1) host ids, column 0 the seed; sets `params["draft_confidence_len"]` (0: no drafts)."""
        params["draft_confidence_len"] = state.confidence_len
        return state.ids

    def forget_all(self) -> None:
        seqs = list(self._by_page.values())
        self._by_page.clear()
        self._give_back([s for s in seqs if s.slot is not None])

    def _sequence_at(self, block_row, pos: int, new: bool) -> _Sequence | None:
        """The sequence whose window ends at `pos` on the row's page (its pages are its own); `new`: a fresh one."""
        page = int(block_row[pos // PAGE_SIZE])
        seq = self._by_page.get(page)
        if new:
            if seq is not None:
                self._by_page.pop(page)
                self._give_back([seq] if seq.slot is not None else [])
            return self._new_sequence(block_row, pos)
        if seq is not None and seq.end == pos:
            return seq
        return None

    def _new_sequence(self, block_row, pos: int) -> _Sequence:
        seq = _Sequence(_Window(self._width, self._keep), pos, int(block_row[pos // PAGE_SIZE]))
        seq.window.first = pos
        self._by_page[seq.page] = seq
        return seq

    def _move(self, seq: _Sequence, page: int) -> None:
        if page != seq.page:
            if self._by_page.get(seq.page) is seq:
                del self._by_page[seq.page]
            seq.page = page
            self._by_page[page] = seq

    def _token_ids(self, block_row, start: int, n: int) -> np.ndarray:
        if self._tokens is None:
            raise RuntimeError("the drafter needs the rows' token ids: call bind(generator) after building the "
                               "Generator (or pass tokens=)")
        ids = np.asarray(self._tokens(block_row, start, n), dtype=np.int32).reshape(-1)
        if len(ids) != n:
            raise RuntimeError(f"token source gave {len(ids)} ids for rows {start}..{start + n - 1}")
        return ids

    def _land(self) -> None:
        copies, self._copies = self._copies, []
        for c in copies:
            if c.event is not None:
                c.event.synchronize()
            taps = c.host.numpy()
            for i, seq, s0, n, ids in c.rows:
                seq.window.append(s0, ids, taps[i, n - len(ids) - c.lo:n - c.lo])

    def _pinned_for(self, shape) -> torch.Tensor:
        n = int(np.prod(shape))
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 1 << 16), dtype=torch.float16, pin_memory=True)
        return self._pinned[:n].view(shape)

    def _release_ended(self, batch: list[_Sequence]) -> None:
        live = {id(s) for s in batch}
        ended = [s for s in self._by_page.values() if s.drafted and id(s) not in live]
        for s in ended:
            del self._by_page[s.page]
        self._give_back([s for s in ended if s.slot is not None])

    def _give_back(self, seqs: list[_Sequence]) -> None:
        slots = [s.slot.grant.slot for s in seqs]
        for s in seqs:
            s.slot = None
        if not slots:
            return
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

    def _step(self, entries) -> list[EntryResult]:
        if not entries:
            return []
        try:
            return self.pool.step(entries, deadline_ms=self.deadline_ms)
        except ClientError as e:
            return [error_result(e.code or Code.UNAVAILABLE, str(e), en.generation) for en in entries]


def _host_list(x) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


class _GeneratorTokens:
    """Token ids of a generator's rows, read from the live sequence whose page at `start` is the row's."""

    def __init__(self, generator):
        self.generator = generator

    def __call__(self, block_row, start: int, n: int) -> np.ndarray:
        page = int(block_row[start // PAGE_SIZE])
        for job in self.generator.active_jobs:
            for seq in job.sequences:
                if int(seq.block_index_tensor[0, start // PAGE_SIZE]) == page:
                    return seq.sequence_ids.torch_slice(start, start + n).reshape(-1).numpy()
        raise RuntimeError(f"no live sequence holds page {page} at position {start}")
