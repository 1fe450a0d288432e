"""``kvflow bench throughput|latency|perplexity --enable-lora --lora-path FOLDER``: every
request runs through the adapter (perplexity equals peft's, computed from its logits); the
half-given and missing-folder forms are one error line, exit 2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvflow.bench.perplexity import windows
from kvflow.entrypoints.cli import main
from kvflow.offline.llm import LLM

_LORA = ["--enable-lora", "--max-lora-rank", "4"]


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory):
    from tests.lora.adapters import make_adapter

    return make_adapter(tiny_llama.path, str(tmp_path_factory.mktemp("lora") / "qv"), 5, r=4,
                        lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def _peft_perplexity(base, adapter_path, ids, window):
    from peft import PeftModel

    model = base if adapter_path is None else PeftModel.from_pretrained(base, adapter_path)
    total, count = 0.0, 0
    for chunk in windows(ids, window):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([chunk])).logits[0, :-1], dim=-1)
        total += float(lp.gather(1, torch.tensor(chunk[1:])[:, None]).sum())
        count += len(chunk) - 1
    if adapter_path is not None:
        model.unload()  # the module-scoped HF model is the base again
    return math.exp(-total / count)


def test_perplexity_runs_through_the_lora_path_adapter(tiny_llama, adapter, tmp_path):
    """``--enable-lora`` had no adapter to apply: the base model's perplexity was reported.
    Now the adapter's, equal to peft's on the same windows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = "the quick brown fox jumps over a lazy dog while kvflow pages keys " * 3
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    out = tmp_path / "ppl.json"
    assert main(["bench", "perplexity", "--model", tiny_llama.path, "--dtype", "float32",
                 "--text-file", str(text_file), "--window", "24", "--num-kv-blocks", "64",
                 "--num-greedy-prompts", "0", "--output-json", str(out), *_LORA,
                 "--lora-path", adapter]) == 0
    got = json.loads(out.read_text())["perplexity"]
    ids = AutoTokenizer.from_pretrained(tiny_llama.path).encode(text)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama.path, dtype=torch.float32).eval()
    want = _peft_perplexity(base, adapter, ids, 24)
    assert want != pytest.approx(_peft_perplexity(base, None, ids, 24), rel=1e-3)
    assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("command", [
    ["throughput", "--num-prompts", "2", "--input-len", "6", "--output-len", "3"],
    ["latency", "--batch-sizes", "2", "--input-len", "6", "--output-len", "3",
     "--num-iters", "1"]])
def test_throughput_and_latency_send_every_request_through_the_adapter(
        tiny_llama, adapter, monkeypatch, command):
    """Every ``LLM.generate`` call of the timed runs (and warm-ups) names the adapter."""
    seen = []
    real = LLM.generate

    def spy(self, prompts, *args, lora_request=None, **kwargs):
        seen.append(lora_request)
        return real(self, prompts, *args, lora_request=lora_request, **kwargs)

    monkeypatch.setattr(LLM, "generate", spy)
    assert main(["bench", *command, "--model", tiny_llama.path, "--dtype", "float32",
                 "--num-kv-blocks", "32", *_LORA, "--lora-path", adapter]) == 0
    assert len(seen) >= 2
    assert all(r is not None and r.lora_path == adapter for r in seen)


@pytest.mark.parametrize("bench", ["throughput", "latency", "perplexity"])
def test_half_given_or_missing_lora_path_is_one_error_line(tiny_llama, tmp_path, capsys,
                                                           bench):
    missing = str(tmp_path / "nope")
    for extra, needle in ((_LORA, "--enable-lora without --lora-path"),
                          (["--lora-path", missing], "needs --enable-lora"),
                          ([*_LORA, "--lora-path", missing], "does not exist")):
        assert main(["bench", bench, "--model", tiny_llama.path, *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err
