"""Test support shared by the tests, the benches and the device tools (not part of the package): seeded STEP
workloads (`workload`), replay and agreement checks (`parity`), the push collectives' scenario harness
(`push_selftest`), a pair that answers at once (`instant_pair`). Importable as `support` with tests/ on sys.path
(pytest puts it there; the benches add it)."""
