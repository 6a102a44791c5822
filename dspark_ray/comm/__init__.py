"""Where the ranks of a pair meet: one interface (`base.Collectives`), one file per backend (`local.py` tp1,
`emulated.py`, `solo.py`, `gloo.py`, `push.py`). `factory.connect` picks one at start-up and logs it."""
from .base import CaptureInfo, CollectiveError, Collectives, MaxPart, Top2Part  # noqa: F401
