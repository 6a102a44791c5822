"""What a deployment is: one worker's `PairSpec` (checkpoint, tp, slots, backend, device, timeouts, pinning,
kernels), checked when it is made so a bad choice fails before any actor starts, and the environment every actor of
it runs in."""
from __future__ import annotations

from dataclasses import dataclass

from .transport.tcp import IDLE_TIMEOUT_S, MAX_CONNECTIONS

# Every actor's environment: never let NCCL / symmetric memory / NVSHMEM build NVLink multicast objects (the
# lent GPU machines forbid them; see the device notes). Set in each actor's runtime_env and checked by a test.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class PairSpec:
    checkpoint: str
    tp: int = 2
    n_slots: int = 16
    backend: str = "gloo"              # collectives of a pair (comm.factory.BACKENDS): gloo (CPU), push (NVLink)
    device: str = "cpu"
    collective_timeout_s: float = 10.0
    step_timeout_s: float | None = None    # the watchdog's bound on one step; None: 2 x collective timeout + 5 s
    torch_threads: int = 1
    # How long a ring party (and the front-end's socket threads) spins before it sleeps: a sleeping party costs a
    # wake-up on every hop. A GPU host has cores to spare, so its parties spin through the trunk's forward between
    # two STEPs (docs/performance.md, the knobs). None: 50 us on CPU, 100 ms on GPU.
    ring_spin_us: float | None = None
    # The step engine: the graph set's static-buffer step (None / True: on; captured as CUDA graphs on a GPU, run
    # uncaptured on a CPU: the same host path and the same bits; False: the eager per-entry path) and the matmul
    # kernels ("auto": the batch-invariant cuBLAS / Triton kernels on CUDA, the exact tree on CPU; "exact"
    # everywhere for a CPU reference to compare against bit for bit).
    graphs: bool | None = None
    matmul: str = "auto"
    # The fast path's dense kernel on a GPU (`gemm.dense_for`): "auto" (Triton's one-read-for-every-chunk kernel
    # when the widest batch spans more than one 32-row chunk, i.e. max_batch >= 7 on the 5-row blocks; cuBLAS up
    # to that, faster at 1 request), "triton" or "cublas".
    dense: str = "auto"
    # vCPUs for the per-step threads (scheduling.pin_thread): rank r's step loop on rank_cpus[r], the front-end's
    # endpoint threads on frontend_cpus. None: wherever the kernel puts them.
    rank_cpus: list[int] | None = None
    frontend_cpus: list[int] | None = None
    # Entries one replay takes: the front-end's `Limits.max_entries_per_replay` (a wider STEP is split into batches)
    # and the ranks' widest graph bucket (graphs.WIDE_BUCKETS); never more than n_slots.
    max_batch: int = 16
    # Cached Markov bias rows (`Drafter.cache_markov`; `markov_cache_rows` reads the choice): "auto" caches every
    # token's row on a GPU when they take at most half the memory left after the weights, "all", "off" or a row
    # count. The same drafts, less read per step (docs/performance.md).
    markov_cache: str = "auto"
    # The STEP endpoint's bounds per client (transport/tcp.py): connections at once (one thread each), and how long a
    # session may go without a request before it is closed and its slots freed (None: for ever).
    max_connections: int = MAX_CONNECTIONS
    idle_timeout_s: float | None = IDLE_TIMEOUT_S
    # Spare rank processes kept per rank, started ahead (imports, CUDA context, kernels done) so a restart after a
    # rank's death skips those (actors/pair.py). Two, so a kill during a restart finds one more. None: 2 on a GPU,
    # 0 on a CPU.
    spare_ranks: int | None = None

    def __post_init__(self):
        # The checks live with what they check (torch's side); importing them here, not at the top, keeps this
        # module torch-free for the front-end's handle and `status`.
        from .comm.factory import check_backend
        from .kernels.gemm import DENSE_KERNELS
        from .model.heads import markov_cache_rows
        check_backend(self.backend, self.tp, self.device)
        # A bad pinning is refused here, before any actor starts, not found later as a thread left unpinned.
        if self.rank_cpus is not None and len(self.rank_cpus) != self.tp:
            raise ValueError(f"rank_cpus {list(self.rank_cpus)}: one vCPU per rank, {self.tp} for tp {self.tp}")
        for name in ("rank_cpus", "frontend_cpus"):
            cpus = getattr(self, name)
            if cpus is not None and (not cpus or any(int(c) < 0 for c in cpus)):
                raise ValueError(f"{name} {list(cpus)}: vCPU numbers >= 0, at least one")
        if self.dense not in ("auto", *DENSE_KERNELS):
            raise ValueError(f"dense {self.dense!r}: auto, {' or '.join(DENSE_KERNELS)}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch {self.max_batch}: at least one entry a replay")
        markov_cache_rows(self.markov_cache, 1)          # a bad choice raises here, before any actor starts
        if self.ring_spin_us is not None and not self.ring_spin_us >= 0:
            raise ValueError(f"ring_spin_us {self.ring_spin_us}: a spin of 0 us or more")
        if self.max_connections < 1:
            raise ValueError(f"max_connections {self.max_connections}: at least 1")
        if self.spare_ranks is not None and not 0 <= self.spare_ranks <= 4:
            raise ValueError(f"spare_ranks {self.spare_ranks}: 0 to 4 spare processes per rank")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s {self.idle_timeout_s}: more than 0 s (or None: no limit)")

    def batch_limit(self, cfg) -> int:
        """Entries a replay takes for a drafter of `cfg`: max_batch, at most one per slot, and on the push pair at
        most what one collective carries (`comm.push.max_rows`: 128 rows, 25 requests of the full preset)."""
        n = min(self.max_batch, self.n_slots)
        if self.backend == "push" and self.tp == 2:
            from .comm.push import max_rows
            n = min(n, max_rows(cfg.hidden_size) // cfg.block_size)
        return max(1, n)

    @property
    def spares(self) -> int:
        if self.spare_ranks is not None:
            return self.spare_ranks
        return 2 if self.device.startswith("cuda") else 0

    @property
    def spin_us(self) -> float:
        if self.ring_spin_us is not None:
            return self.ring_spin_us
        return 100_000.0 if self.device.startswith("cuda") else 50.0
