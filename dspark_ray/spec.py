"""One worker's `PairSpec`, checked when made so a bad choice fails before any actor starts (its knobs:
docs/operations.md, "Knobs"), and the environment every actor runs in."""
from __future__ import annotations

from dataclasses import dataclass

from .transport.tcp import IDLE_TIMEOUT_S, MAX_CONNECTIONS

# No NVLink multicast objects: the lent GPU machines forbid them (checked by a test).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass
class PairSpec:
    checkpoint: str
    tp: int = 2
    n_slots: int = 16
    backend: str = "gloo"              # gloo (CPU) or push (NVLink)
    device: str = "cpu"
    collective_timeout_s: float = 10.0
    step_timeout_s: float | None = None    # the watchdog; None: 2 x collective timeout + 5 s
    torch_threads: int = 1
    # A sleeping party costs a wake-up on every hop; a GPU host's cores spin through the trunk's forward.
    ring_spin_us: float | None = None
    # None / True: the static-buffer step (CUDA graphs on a GPU; the same bits uncaptured on a CPU); "exact"
    # matmuls everywhere give a CPU reference to compare bit for bit.
    graphs: bool | None = None
    matmul: str = "auto"
    dense: str = "auto"                    # gemm.dense_for
    rank_cpus: list[int] | None = None
    frontend_cpus: list[int] | None = None
    max_batch: int = 16                    # also the ranks' widest graph bucket
    markov_cache: str = "auto"
    max_connections: int = MAX_CONNECTIONS
    idle_timeout_s: float | None = IDLE_TIMEOUT_S
    spare_ranks: int | None = None         # two on a GPU, so a kill during a restart finds one more

    def __post_init__(self):
        # Imported here: this module stays torch-free for the front-end's handle and `status`.
        from .comm.factory import check_backend
        from .kernels.gemm import DENSE_KERNELS
        from .model.heads import markov_cache_rows
        check_backend(self.backend, self.tp, self.device)
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
        markov_cache_rows(self.markov_cache, 1)
        if self.ring_spin_us is not None and not self.ring_spin_us >= 0:
            raise ValueError(f"ring_spin_us {self.ring_spin_us}: a spin of 0 us or more")
        if self.max_connections < 1:
            raise ValueError(f"max_connections {self.max_connections}: at least 1")
        if self.spare_ranks is not None and not 0 <= self.spare_ranks <= 4:
            raise ValueError(f"spare_ranks {self.spare_ranks}: 0 to 4 spare processes per rank")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s {self.idle_timeout_s}: more than 0 s (or None: no limit)")

    def batch_limit(self, cfg) -> int:
        """Entries a replay takes: max_batch, one per slot at most, and on the push pair what one collective carries."""
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
