"""What runs in a rank's process: the rank as a plain object and its ring loop (`worker.py`), the step engine
(`engine.py`), its CUDA graphs (`graphs/`), which shards a process holds (`modes.py`), fault injection (`faults.py`)."""
