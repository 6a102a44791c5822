"""What runs in the front-end's process: the STEP service (`step_service.py`), the ring's driver (`ring_driver.py`),
the restart policy (`supervisor.py`). Torch-free."""
