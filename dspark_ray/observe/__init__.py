"""Measurement, hooked in at the seams: the observer interfaces (`observers.py`), the recorders the actors hand in
(`recorders.py`), time stamps (`stamps.py`), wake-up counts (`wake_ups.py`), keep-warm rehearsals (`keep_warm.py`),
the Prometheus exporter (`metrics.py`)."""
