"""Support shared by the tests, the benches and the device tools (nothing of the service imports it): seeded STEP
workloads (`workload`), replay and agreement checks (`parity`), the push collectives' scenario harness
(`push_selftest`), a pair that answers at once (`instant_pair`). In the package so that tests/ and bench/ both
import it as `dspark_ray.testing`, neither putting the other on sys.path."""
