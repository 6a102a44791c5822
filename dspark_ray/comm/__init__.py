"""Where the ranks of a pair meet: one interface (`base.Collectives`), one file per way of meeting.

| backend    | file          | where                                                                      |
|------------|---------------|----------------------------------------------------------------------------|
| `tp1`      | `local.py`    | one unsplit rank; also the split reference (both partials, one caller)     |
| `emulated` | `emulated.py` | both ranks of a pair in one process, one thread each (the CPU tests)       |
| `solo`     | `solo.py`     | one rank of a pair alone, local stand-ins (timing one rank's compute)      |
| `gloo`     | `gloo.py`     | two processes over torch.distributed gloo: the CPU pair                    |
| `push`     | `push.py`     | two cards over NVLink: one-shot push kernels on CUDA IPC peer memory       |

`factory.connect` chooses one at start-up, after a capability check, and logs the choice; the step path never
branches on the backend. `reference.py` is the torch oracle the push kernels are checked against.
"""
from .base import CaptureInfo, CollectiveError, Collectives, MaxPart, Top2Part  # noqa: F401
