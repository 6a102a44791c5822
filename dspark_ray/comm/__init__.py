"""Where the ranks of a pair meet: the backends of the model's `Collectives` interface (`model/collectives.py`,
which also holds `LocalCollectives`, tp1 and the split reference), one file each (`emulated.py`, `solo.py`,
`gloo.py`, `push.py`). `factory.connect` picks one at start-up and logs it."""
from ..model.collectives import CaptureInfo, CollectiveError, Collectives, MaxPart, Top2Part  # noqa: F401
