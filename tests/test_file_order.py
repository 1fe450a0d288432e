"""tests/file_order.py: the order ``pytest -n 2`` hands test files out in (costliest first,
each file's tests together and in their own order), the cost table it reads, and
scripts/file_costs.py, which writes that table from a durations report. Expected orders and
sums are worked out by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.file_order import (
    COSTS_PATH,
    SHARED_STATE_GROUPS,
    costliest_files_first,
    grouped_loadfile_scheduling,
    read_costs,
    unit_of,
)

ROOT = Path(__file__).resolve().parents[1]


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_costliest_files_first_keeps_each_files_tests_together_in_order():
    items = _items("tests/a.py::t1", "tests/b.py::t1", "tests/a.py::t2[x]",
                   "tests/c.py::C::t1", "tests/b.py::t2", "tests/d.py::t1")
    costs = {"tests/a.py": 1.0, "tests/b.py": 5.0, "tests/c.py": 3.0}
    ordered = costliest_files_first(items, costs, default=2.0)
    assert [item.nodeid for item in ordered] == [
        "tests/b.py::t1", "tests/b.py::t2",  # 5 s
        "tests/c.py::C::t1",  # 3 s
        "tests/d.py::t1",  # not listed: the default, 2 s
        "tests/a.py::t1", "tests/a.py::t2[x]"]  # 1 s
    assert sorted(map(id, ordered)) == sorted(map(id, items))  # the same objects, none lost


def test_equal_costs_keep_the_collection_order():
    items = _items("tests/z.py::t", "tests/y.py::t", "tests/x.py::t")
    assert [i.nodeid for i in costliest_files_first(items, {})] == \
        ["tests/z.py::t", "tests/y.py::t", "tests/x.py::t"]


def test_read_costs(tmp_path):
    table = tmp_path / "costs.txt"
    table.write_text("# seconds path\n12.5 tests/a.py\n\n0.3 tests/e2e/b.py\n")
    assert read_costs(table) == {"tests/a.py": 12.5, "tests/e2e/b.py": 0.3}
    assert read_costs(tmp_path / "missing.txt") == {}
    table.write_text("12.5 tests/a.py\ntests/b.py\n")
    with pytest.raises(ValueError, match=r"costs.txt:2: expected 'seconds path'"):
        read_costs(table)


def test_the_checked_in_table_reads_and_lists_test_files():
    costs = read_costs(COSTS_PATH)
    assert len(costs) > 100
    assert all(name.startswith("tests/") and name.endswith(".py") and seconds >= 0
               for name, seconds in costs.items())


def test_file_costs_script_sums_each_files_phases(tmp_path):
    run1 = tmp_path / "run1.log"
    run1.write_text("=== slowest durations ===\n"
                    "3.50s call     tests/a.py::test_x[1]\n"
                    "0.25s setup    tests/a.py::test_x[1]\n"
                    "1.00s teardown tests/a.py::test_y\n"
                    "2.00s call     tests/b.py::C::test_z\n"
                    "(3 durations < 0.005s hidden.)\n")
    run2 = tmp_path / "run2.log"
    run2.write_text("4.00s call tests/b.py::C::test_z\n")
    script = [sys.executable, str(ROOT / "scripts" / "file_costs.py")]
    out = subprocess.run([*script, str(run1), str(run2)], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    # a: 3.5 + 0.25 + 1.0 in run1 only; b: the mean of 2.0 and 4.0
    assert out[1:] == ["4.8 tests/a.py", "3.0 tests/b.py"]
    empty = tmp_path / "empty.log"
    empty.write_text("no durations here\n")
    failed = subprocess.run([*script, str(empty)], check=False, capture_output=True,
                            text=True)
    assert failed.returncode == 2 and "empty.log: no '--durations' lines" in failed.stderr


def test_the_conftest_hook_orders_only_an_xdist_workers_collection(monkeypatch):
    from tests import conftest

    costs = read_costs(COSTS_PATH)
    cheap, dear = min(costs, key=costs.get), max(costs, key=costs.get)
    items = _items(f"{cheap}::t", f"{dear}::t")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    conftest.pytest_collection_modifyitems(None, items)  # serial: collection order kept
    assert [i.nodeid for i in items] == [f"{cheap}::t", f"{dear}::t"]
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == [f"{dear}::t", f"{cheap}::t"]


def test_a_group_of_files_is_one_unit_costing_their_sum():
    groups = (("tests/g1.py", "tests/g2.py"),)
    items = _items("tests/a.py::t", "tests/g2.py::t", "tests/b.py::t", "tests/g1.py::t1",
                   "tests/g1.py::t2")
    costs = {"tests/a.py": 5.0, "tests/b.py": 4.0, "tests/g1.py": 3.0, "tests/g2.py": 2.5}
    ordered = costliest_files_first(items, costs, groups=groups)
    # the group (3 + 2.5 = 5.5) before a.py (5) and b.py (4), its files in collection order
    assert [i.nodeid for i in ordered] == ["tests/g2.py::t", "tests/g1.py::t1",
                                           "tests/g1.py::t2", "tests/a.py::t", "tests/b.py::t"]
    assert unit_of("tests/g2.py", groups) == "tests/g1.py"
    assert unit_of("tests/a.py", groups) == "tests/a.py"


def test_the_groups_list_test_files_once_each():
    listed = [name for group in SHARED_STATE_GROUPS for name in group]
    assert len(listed) == len(set(listed))
    assert all((ROOT / name).is_file() for name in listed), \
        [name for name in listed if not (ROOT / name).is_file()]


def test_the_scheduler_gives_a_groups_files_one_scope():
    """xdist's loadfile scheduler splits node ids into scopes by file; the grouped one maps
    a group's files to the group's first file (one work unit, one worker)."""
    pytest.importorskip("xdist")
    first, second = SHARED_STATE_GROUPS[0][:2]
    cls = grouped_loadfile_scheduling()
    sched = cls.__new__(cls)  # its _split_scope reads no state (__init__ needs -n's workers)
    assert sched._split_scope(f"{second}::test_x[1]") == first
    assert sched._split_scope(f"{first}::C::test_y") == first
    assert sched._split_scope("tests/test_alone.py::test_z") == "tests/test_alone.py"
