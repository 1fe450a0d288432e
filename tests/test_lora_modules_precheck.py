"""``kvflow serve --lora-modules NAME=PATH``: an adapter whose folder is missing, has no
adapter_config.json, or whose rank is above ``--max-lora-rank`` is one ``kvflow: error:``
line, exit 2, before the model loads.

Before: the model loaded and the engine started, then the server's start-up hook failed and
uvicorn printed a 20-line traceback ending in the reason and "Application startup failed.
Exiting.", exit 3."""

from __future__ import annotations

import json
import os

import pytest


def _serve(monkeypatch, capsys, flags: list[str]) -> tuple[int, list[str]]:
    from kvflow.engine import async_llm
    from kvflow.entrypoints.cli import main

    def no_engine(*args, **kw):
        raise AssertionError("the engine was started")

    monkeypatch.setattr(async_llm.AsyncLLM, "__init__", no_engine)
    rc = main(["serve", "SmolLM2-135M-Instruct", "--port", "0", "--enable-lora", *flags])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_missing_folder(monkeypatch, capsys, tmp_path):
    missing = str(tmp_path / "nope")
    rc, err = _serve(monkeypatch, capsys, ["--lora-modules", f"a={missing}"])
    assert (rc, err) == (2, [(f"kvflow: error: --lora-modules a={missing}: LoRA adapter "
                             f"{missing!r} does not exist (a PEFT folder is expected)")])


def test_folder_without_config(monkeypatch, capsys, tmp_path):
    rc, err = _serve(monkeypatch, capsys, ["--lora-modules", f"a={tmp_path}"])
    assert (rc, err) == (2, [(f"kvflow: error: --lora-modules a={tmp_path}: LoRA adapter "
                             f"{str(tmp_path)!r} has no adapter_config.json (a PEFT folder is "
                             "expected)")])


@pytest.mark.parametrize("config, reason", [
    ({"peft_type": "LORA", "r": 8, "lora_alpha": 16},
     "rank 8 exceeds --max-lora-rank=4 (start the engine with --max-lora-rank 8 or more)"),
    ({"peft_type": "LORA", "r": 4, "use_dora": True},
     "use_dora=True: DoRA adapters are not supported"),
], ids=["rank", "dora"])
def test_config_refused(monkeypatch, capsys, tmp_path, config, reason):
    with open(tmp_path / "adapter_config.json", "w") as f:
        json.dump(config, f)
    where = repr(os.path.join(str(tmp_path), "adapter_config.json"))
    rc, err = _serve(monkeypatch, capsys, ["--max-lora-rank", "4",
                                           "--lora-modules", f"big={tmp_path}"])
    assert rc == 2 and len(err) == 1, err
    prefix = f"kvflow: error: --lora-modules big={tmp_path}: "
    assert err[0].startswith(prefix) and err[0].endswith(reason), err
    assert where in err[0]
