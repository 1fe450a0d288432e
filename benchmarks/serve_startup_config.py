"""The config reads on ``kvflow serve``'s start-up path, timed in a fresh interpreter (run it
with ``PYTHONPATH`` at the tree to time; one figure a run, in seconds).

``front``: the API process's reads of the packaged GGUF (``load_gguf_config``,
``load_gguf_tokenizer``, ``gguf_eos_token_ids``), transformers' classes imported first.
``core MODEL``: an engine core's ``load_hf_config`` after its start gate (``wait_for_go``, let
go after 50 ms), i.e. what the core still does after the go.

    PYTHONPATH=$TREE python benchmarks/serve_startup_config.py front
    PYTHONPATH=$TREE python benchmarks/serve_startup_config.py core out/smollm2-hf
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def time_front() -> float:
    """Seconds of the API process's three reads of SmolLM2-135M-Instruct's GGUF."""
    import transformers

    from kvflow.models.gguf_config import load_gguf_config
    from kvflow.models.gguf_tokenizer import gguf_eos_token_ids, load_gguf_tokenizer
    from kvflow.models.model_resolver import resolve_model

    for name in ("AutoConfig", "AutoTokenizer", "LlamaConfig"):  # imported outside the timing
        getattr(transformers, name)
    path = resolve_model("SmolLM2-135M-Instruct").path
    start = time.perf_counter()
    load_gguf_config(path)
    load_gguf_tokenizer(path)
    gguf_eos_token_ids(path)
    return time.perf_counter() - start


def time_core(model: str) -> float:
    """Seconds of an engine core's config load of ``model`` after its start gate."""
    import zmq

    from kvflow.engine.core_process_setup import wait_for_go
    from kvflow.models.loader import load_hf_config
    from kvflow.models.model_resolver import resolve_model

    go = Path(tempfile.mkdtemp()) / "go"
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("inproc://gate")
    threading.Timer(0.05, go.touch).start()
    wait_for_go(str(go), pull)
    source = resolve_model(model)
    start = time.perf_counter()
    load_hf_config(source)
    seconds = time.perf_counter() - start
    pull.close(0)
    ctx.term()
    return seconds


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "front"
    print(f"{what} {time_front() if what == 'front' else time_core(sys.argv[2]):.3f}")
