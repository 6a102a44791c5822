"""What crosses a boundary between processes: the STEP contract (`contract.py`), its framing (`wire.py`), the taps'
finite check (`finite.py`), the deployment's token (`access_token.py`), what travels on the step ring
(`records.py`) and where a slot stands (`slot_cursor.py`)."""
