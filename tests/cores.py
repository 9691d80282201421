"""The cores a test's own processes may use: the machine's, shared by the pytest-xdist workers
running at once (xdist sets PYTEST_XDIST_WORKER_COUNT in each worker), at least one.

A test that starts a run with more threads than its share makes OpenMP's spinning barriers fight
the other worker's processes for the same cores: on 2 cores with 2 workers, the short demo at 2
threads took 1,468 s beside the other worker's tests, against 377 s alone.
"""
import os


def share() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)
