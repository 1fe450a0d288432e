"""README's ``AsyncLLM`` example ("In an asyncio program"), run as the README shows it: a
script file with the ``__main__`` guard, its engine core in a process of its own. The model
name is swapped for a tiny model's folder, with a KV cache of 64 blocks (the CPU default of
2 GiB is zeroed page by page at start-up: seconds of the test's time, and nothing it checks).
Oracle: transformers' greedy continuation of the prompt (each streamed text is the whole text
so far, vLLM's default, the last its decoded text) and the finished flags."""

from __future__ import annotations

import ast
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text[text.index("### In an asyncio program (`AsyncLLM`)"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_readme_asyncllm_example_streams_the_greedy_text(tiny_llama, tmp_path):
    code = _example()
    assert 'model="SmolLM2-135M-Instruct"' in code and 'if __name__ == "__main__":' in code
    script = tmp_path / "example.py"
    script.write_text(code.replace('model="SmolLM2-135M-Instruct"',
                                   f"model={tiny_llama.path!r}, num_kv_blocks=64"))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, check=True, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.splitlines()
    pieces = [line.rsplit(" ", 1) for line in out]
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    ids = tokenizer.encode("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        greedy = tiny_llama.hf_model.generate(ids, do_sample=False, max_new_tokens=8,
                                              pad_token_id=0)[0, ids.shape[1]:]
    eos_at = (greedy == tiny_llama.eos_token_id).nonzero()
    greedy = greedy[:int(eos_at[0]) + 1] if len(eos_at) else greedy  # the engine stops at EOS
    texts = [ast.literal_eval(text) for text, _ in pieces]
    want = tokenizer.decode(greedy, skip_special_tokens=True)
    # cumulative (vLLM's default): each the whole text so far, the last the greedy text
    assert len(texts) > 1 and texts[-1] == want
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert [flag for _, flag in pieces] == ["False"] * (len(pieces) - 1) + ["True"]
