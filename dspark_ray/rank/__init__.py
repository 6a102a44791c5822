"""What runs in a rank's process: the rank as a plain object and its ring loop (`worker.py`), the step engine
(`engine.py`), its CUDA graphs (`graphs/`), which shards a process holds (`modes.py`), fault injection (`faults.py`)."""
import time

# When this process began importing the rank's code, before torch: the start-up's "imports" phase (rank/worker.py's
# `startup`). Here because a package's __init__ runs before any of its modules, so no import has to wait below it.
IMPORTS_BEGAN = time.time()
