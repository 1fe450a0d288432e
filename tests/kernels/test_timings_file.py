"""The timings cache file shared by the GEMM and prefill-attention choices
(``kernels/timings_file.py``): a round trip, a missing or corrupt file read as empty, and a
write that cannot happen reported (False, a warning) instead of raised."""

from __future__ import annotations

import logging

from kvflow.kernels.timings_file import read_timings, write_timings


def test_round_trip_and_no_temporary_file_left(tmp_path):
    path = tmp_path / "sub" / "t.json"
    assert write_timings(path, {"b": 2.5, "a": 0.125}, "test timings")
    assert read_timings(path) == {"a": 0.125, "b": 2.5}
    assert [p.name for p in path.parent.iterdir()] == ["t.json"]


def test_missing_or_corrupt_file_reads_as_empty(tmp_path):
    assert read_timings(tmp_path / "none.json") == {}
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert read_timings(bad) == {}


def test_unwritable_place_is_a_warning_not_an_error(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be
    with caplog.at_level(logging.WARNING):
        assert not write_timings(blocker / "t.json", {"a": 1.0}, "test timings")
    assert "could not cache test timings" in caplog.text
