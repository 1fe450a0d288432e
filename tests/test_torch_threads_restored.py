"""tests/conftest.py puts torch's intra-op thread count back after a test that changed it
(an in-process engine with ``cpu_threads`` sets it for the whole process, and fp32 results
may differ in the last bits between counts): the first test changes it, the second finds the
count the conftest set (``KVFLOW_TEST_NUM_THREADS``, default 1)."""

from __future__ import annotations

import os

import torch

SUITE_THREADS = int(os.environ.get("KVFLOW_TEST_NUM_THREADS", "1"))


def test_a_test_changes_torchs_thread_count():
    assert torch.get_num_threads() == SUITE_THREADS
    torch.set_num_threads(SUITE_THREADS + 1)
    assert torch.get_num_threads() == SUITE_THREADS + 1


def test_the_next_test_finds_the_suites_count():
    assert torch.get_num_threads() == SUITE_THREADS
