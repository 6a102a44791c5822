"""A draft's answers on the host: the packed download read into the contract's dtypes.

A draft graph packs each request's drafts, confidences, margins (when asked) and confident length into one row of
fp64 (int64 ids and fp32 scores are exact in fp64), and that tensor comes back in one device-to-host copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...model.drafter import DraftOut


@dataclass
class HostDraft:
    """A batch's drafts on the host in the contract's dtypes, converted once per batch (per-entry torch calls cost
    several us each when cold)."""
    drafts: np.ndarray                  # (bsz, n_out) int32
    confidences: np.ndarray             # (bsz, n_out) fp32
    margins: np.ndarray | None          # (bsz, n_out) fp32, when asked for
    confident_len: list[int]

    @staticmethod
    def of(out: DraftOut) -> "HostDraft":
        def host(t, dtype):
            return (t if t.device.type == "cpu" else t.cpu()).numpy().astype(dtype, copy=False)
        return HostDraft(host(out.drafts, np.int32), host(out.confidences, np.float32),
                         host(out.margins, np.float32) if out.margins is not None else None,
                         host(out.confident_len, np.int64).tolist())


def packed_size(bucket: int, drafted: int, want_margins: bool) -> int:
    """The fp64 values a draft of `bucket` requests, `drafted` drafts each, downloads."""
    return bucket * ((2 + want_margins) * drafted + 1)


def read_outputs(out: np.ndarray, size: int, n: int, n_out: int, drafted: int, want_margins: bool,
                 host_draft: bool) -> DraftOut | HostDraft:
    """The first n requests' answers from the download `out[:size]` of a bucket that drafted `drafted` >= n_out: the
    first n_out drafts, scores and margins, and the confident prefix cut at n_out (the prefix of the first n_out
    drafts: the loop never looks ahead)."""
    k = drafted
    a = out[:size].reshape(-1, (2 + want_margins) * k + 1)[:n]
    drafts, confs, lens = a[:, :n_out], a[:, k:k + n_out], a[:, (2 + want_margins) * k]
    if n_out < k:
        lens = np.minimum(lens, n_out)
    margins = a[:, 2 * k:2 * k + n_out] if want_margins else None
    # (astype copies: the pinned buffer is the next step's)
    if host_draft:
        return HostDraft(drafts.astype(np.int32), confs.astype(np.float32),
                         margins.astype(np.float32) if want_margins else None, lens.astype(np.int64).tolist())
    return DraftOut(drafts=torch.from_numpy(drafts.astype(np.int64)),
                    confidences=torch.from_numpy(confs.astype(np.float32)),
                    confident_len=torch.from_numpy(lens.astype(np.int64)),
                    margins=torch.from_numpy(margins.astype(np.float32)) if want_margins else None, logits=None)
