"""CUDA IPC export / import of a rank's peer state, and the checks made before two ranks trust each other.
A `PeerHandle` pickles; it maps the peer card's memory even where a process sees only its own card.
"""
from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass

from ..model.collectives import CollectiveError

HANDLE_VERSION = 1


@dataclass(frozen=True)
class PeerHandle:
    version: int
    rank: int
    ipc_handle: bytes           # cudaIpcMemHandle_t of the state allocation
    nbytes: int
    layout_digest: str
    max_words: int
    nonce: int                  # what this rank expects the peer to write into its hello word
    pid: int
    host: str
    device: str                 # name and uuid, for the logs
    protocol: str = ""          # all-reduce / exchange variant and ack ordering: both ranks must run the same

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "PeerHandle":
        return PeerHandle(**d)


def check_peer_handle(mine: PeerHandle, peer: PeerHandle) -> None:
    """Refuse a peer that cannot be this rank's partner; the message names the field, both values and the rule."""
    def refuse(field, a, b, rule):
        raise CollectiveError(f"push: peer handle refused: {field}: mine {a!r}, peer's {b!r}: {rule}")
    if peer.version != HANDLE_VERSION:
        refuse("version", HANDLE_VERSION, peer.version, "both ranks must run the same push protocol version")
    if peer.rank != 1 - mine.rank:
        refuse("rank", mine.rank, peer.rank, "a pair is rank 0 and rank 1")
    if peer.layout_digest != mine.layout_digest:
        refuse("layout_digest", mine.layout_digest, peer.layout_digest,
               "both ranks must compile the same state layout (max_words, maxb, maxx)")
    if peer.max_words != mine.max_words:
        refuse("max_words", mine.max_words, peer.max_words, "both ranks must size their buffers alike")
    if peer.protocol != mine.protocol:
        refuse("protocol", mine.protocol, peer.protocol, "both ranks must run the same collective variants")
    if peer.nbytes != mine.nbytes:
        refuse("nbytes", mine.nbytes, peer.nbytes, "the state allocations must have the same size")
    if len(peer.ipc_handle) != 64:
        refuse("ipc_handle", 64, len(peer.ipc_handle), "a cudaIpcMemHandle_t is 64 bytes")
    if peer.host != mine.host:
        refuse("host", mine.host, peer.host, "CUDA IPC only works between processes of one host")
    if peer.pid == mine.pid:
        refuse("pid", mine.pid, peer.pid, "a process cannot open its own IPC handle: use connect_local() for "
               "both ranks in one process")
    if peer.nonce == 0 or peer.nonce == mine.nonce:
        refuse("nonce", mine.nonce, peer.nonce, "nonces must be non-zero and distinct")


def this_host() -> str:
    return socket.gethostname()


def this_pid() -> int:
    return os.getpid()


def export_ipc_handle(ptr: int) -> bytes:
    import cupy as cp
    return bytes(cp.cuda.runtime.ipcGetMemHandle(ptr))


def open_ipc_handle(handle: bytes) -> int:
    """Map the peer's allocation; the pointer is a UVA address that kernels of this process can store through."""
    import cupy as cp
    rt = cp.cuda.runtime
    try:
        return int(rt.ipcOpenMemHandle(handle, getattr(rt, "cudaIpcMemLazyEnablePeerAccess", 1)))
    except Exception as e:                                       # cupy raises CUDARuntimeError
        raise CollectiveError(f"push: cannot open the peer's CUDA IPC handle ({e}): the cards are not P2P "
                              "reachable from here (the push pair needs two cards joined by NVLink)") from e


def close_ipc_handle(ptr: int) -> None:
    import cupy as cp
    cp.cuda.runtime.ipcCloseMemHandle(ptr)
