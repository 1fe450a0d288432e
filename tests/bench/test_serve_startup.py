"""benchmarks/serve_startup.py starts each tree's own kvflow: run from a clone's root (as its
docstring's command is), ``python -m kvflow`` put that root on ``sys.path`` ahead of
``PYTHONPATH``, so every "tree" imported the same kvflow and a before/after comparison timed
one tree twice. The oracle: which ``kvflow/__init__.py`` Python itself reports importing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _serve_startup(monkeypatch):
    monkeypatch.syspath_prepend(str(_BENCH))  # its `from serve_harness import ...`
    spec = importlib.util.spec_from_file_location("serve_startup", _BENCH / "serve_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_tree_imports_its_own_kvflow_from_a_clones_root(monkeypatch, tmp_path):
    tree = tmp_path / "tree"
    (tree / "kvflow").mkdir(parents=True)
    (tree / "kvflow" / "__init__.py").write_text("")
    monkeypatch.chdir(_BENCH.parent)  # a clone's root: it has a kvflow package of its own
    process = _serve_startup(monkeypatch).tree_process(str(tree))
    found = subprocess.run([sys.executable, "-c", "import kvflow; print(kvflow.__file__)"],
                           capture_output=True, text=True, check=True, timeout=60,
                           **process).stdout.strip()
    assert found == str(tree / "kvflow" / "__init__.py")
    assert process["env"]["PYTHONPATH"] == str(tree) and process["env"]["HF_HUB_OFFLINE"] == "1"
    was = subprocess.run([sys.executable, "-c", "import kvflow; print(kvflow.__file__)"],
                         capture_output=True, text=True, check=True, timeout=60,
                         env=process["env"]).stdout.strip()  # the old harness: PYTHONPATH only
    assert was == str(_BENCH.parent / "kvflow" / "__init__.py")


def test_summary_takes_medians_per_key_and_over_every_later_request(monkeypatch):
    runs = [{"health_s": 8.0, "first_gen_s": 1.5, "first_ttft_s": 0.9, "next_gen_s": [0.3, 0.2]},
            {"health_s": 18.0, "first_gen_s": 0.4, "first_ttft_s": 0.1, "next_gen_s": [0.25]},
            {"health_s": 9.0, "first_gen_s": 0.5, "first_ttft_s": 0.2, "next_gen_s": [9.0]}]
    assert _serve_startup(monkeypatch).summary(runs) == {
        "health_s": 9.0, "first_gen_s": 0.5, "first_ttft_s": 0.2, "next_gen_s": 0.275}
