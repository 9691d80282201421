"""`write_named`: megatron's checkpoint writers in threads, a failed one named by file and cause.

megatron-core 0.19's own threaded writer reports a failed write as "An error is caught while starting
worker 0, error: <class ...>" (tests/e2e/test_drills_round3.py shows the run's line on a full disk).
Here the writers write real (empty) buckets through megatron's `write_preloaded_data`, one of them
into a folder that does not exist."""
import pytest

from megatron_rl.platform.checkpoint_writer import WriterFailed, write_named


class Results:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)


def bucket(path):
    return (str(path), "storage-key", ([], []))   # (file, storage key, (bytes items, tensor items))


def test_every_writer_writes_and_the_results_come_back_by_index(tmp_path):
    results = Results()
    write_named([], False, 0, [bucket(tmp_path / "a.distcp"), bucket(tmp_path / "b.distcp")], results)
    assert results.items == [{0: [], 1: []}]
    assert (tmp_path / "a.distcp").exists() and (tmp_path / "b.distcp").exists()


def test_a_failed_writer_names_its_file_and_its_error(tmp_path):
    results, bad = Results(), tmp_path / "missing" / "b.distcp"
    write_named([], False, 0, [bucket(tmp_path / "a.distcp"), bucket(bad)], results)
    [failure] = results.items
    assert isinstance(failure, WriterFailed)
    assert str(failure).startswith(f"writing {bad}: FileNotFoundError: ") and str(bad.parent) in str(failure)
    assert (tmp_path / "a.distcp").exists()   # the other writer finished: every thread is joined


def test_a_gone_results_queue_is_named():
    class Gone:
        def put(self, item):
            raise EOFError

    with pytest.raises(WriterFailed, match="results queue is gone"):
        write_named([], False, 0, [], Gone())
