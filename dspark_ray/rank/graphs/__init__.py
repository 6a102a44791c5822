"""CUDA graphs of one rank's step: the draft for every (requests 1..4) x (n_out 1..B) x (plain, margins) bucket,
wider batches in wide buckets (padded, n_out B), the context insert for row buckets up to 128, and a step graph per
draft key that runs a decode round's insert beside its draft; captured once at start-up over static buffers.

    inputs.py           the pinned input buffer and its layout (one upload per graph)
    buckets.py          which graph a step runs: request buckets, draft keys, insert buckets, step rows
    step_functions.py   what the graphs run on the device: the insert into the slot pool, the draft over it
    copies.py           the copies inside the graphs: the upload, the download of the answers and control words
    outputs.py          the download read into the answers (HostDraft)
    capture.py          capturing the graphs (all at start-up, or a restart's first and the rest between steps)
    graph_set.py        GraphSet: the slot pool, a step staged, launched and unpacked on the host

A replay runs the eager path's kernels, so it gives the eager bits.
"""
from .buckets import EXACT_REQUESTS, INSERT_BUCKETS, MAX_REQUESTS, WIDE_BUCKETS, step_graphs_enabled
from .graph_set import GraphSet
from .outputs import HostDraft

__all__ = ["GraphSet", "HostDraft", "MAX_REQUESTS", "EXACT_REQUESTS", "WIDE_BUCKETS", "INSERT_BUCKETS",
           "step_graphs_enabled"]
