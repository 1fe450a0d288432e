"""The timings cache file shared by the GEMM and prefill-attention choices
(``kernels/timings_file.py``): a round trip, a missing or corrupt file read as empty, a damaged
one (valid JSON that is not an object of seconds) read as its valid entries with a warning, and
a write that cannot happen reported (False, a warning) instead of raised."""

from __future__ import annotations

import logging

import pytest

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


@pytest.mark.parametrize("text, kept, problem", [
    ('{"a": 0.5, "b": 2', {}, "the content (not JSON: "),  # truncated mid-write
    ("null", {}, "the content (a JSON null, not an object of seconds)"),
    ("[1, 2]", {}, "the content (a JSON array, not an object of seconds)"),
    ('"fast"', {}, "the content (a JSON string, not an object of seconds)"),
    ("0.5", {}, "the content (a JSON number, not an object of seconds)"),
    ('{"a": "fast", "b": 0.5}', {"b": 0.5}, "1 of 2 entries (e.g. 'a': 'fast'"),
    (('{"a": 0, "b": -1e-3, "c": NaN, "d": Infinity, "e": true, "f": null, "g": [1], "h": 2,'
      f' "i": 1e400, "j": 1{"0" * 400}}}'),  # j: an int too large for a float
     {"h": 2.0}, "9 of 10 entries (e.g. 'a': 0, not seconds above 0)"),
])
def test_damaged_file_keeps_its_valid_entries_and_warns(tmp_path, caplog, text, kept, problem):
    """Valid JSON of the wrong kind used to reach the kernel choice and fail there (a
    TypeError on ``null`` or a string, ZeroDivisionError on 0 seconds): only entries that are
    finite times above 0 are kept (ints read as floats; bools, NaN, inf, 1e400 and an int too
    large for a float are not), and the warning names the file and the first bad entry."""
    path = tmp_path / "t.json"
    path.write_text(text)
    with caplog.at_level(logging.WARNING):
        got = read_timings(path)
    assert got == kept and all(type(v) is float for v in got.values())
    assert f"ignoring {problem}" in caplog.text and str(path) in caplog.text
    assert "measuring again" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert read_timings(path, warn=False) == kept
        assert read_timings(tmp_path / "none.json") == {}  # missing: nothing to warn about
    assert caplog.text == ""


def test_unwritable_place_is_a_warning_not_an_error(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be
    with caplog.at_level(logging.WARNING):
        assert not write_timings(blocker / "t.json", {"a": 1.0}, "test timings")
    assert "could not cache test timings" in caplog.text
