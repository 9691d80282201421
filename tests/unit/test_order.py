"""tests/order.py: the long files go to the xdist workers first, the rest keep their collection
order, a file's tests stay together; every file LONG_FILES names exists (a renamed file would
silently drop out of the schedule)."""
from pathlib import Path

from tests.order import LONG_FILES, longest_first

TESTS = Path(__file__).resolve().parents[1]


def test_long_files_first_and_the_rest_in_collection_order():
    paths = ["unit/a.py", "e2e/test_demo_short.py", "unit/a.py", "unit/b.py", "e2e/test_repro_quick.py",
             "e2e/test_demo_short.py", "unit/c.py"]
    ordered = [paths[i] for i in longest_first(paths)]
    by_time = sorted({"e2e/test_demo_short.py", "e2e/test_repro_quick.py"}, key=lambda f: -LONG_FILES[f])
    assert LONG_FILES[by_time[0]] > LONG_FILES[by_time[1]]  # the example needs two different times
    assert ordered == [p for f in by_time for p in paths if p == f] + ["unit/a.py", "unit/a.py", "unit/b.py", "unit/c.py"]
    assert sorted(longest_first(paths)) == list(range(len(paths)))  # a permutation: no test lost


def test_a_files_tests_keep_their_order():
    paths = ["e2e/test_drills.py"] * 3 + ["unit/x.py"]
    assert longest_first(paths) == [0, 1, 2, 3]


def test_every_long_file_exists():
    missing = [f for f in LONG_FILES if not (TESTS / f).is_file()]
    assert not missing, f"tests/order.py names files that do not exist: {missing}"
