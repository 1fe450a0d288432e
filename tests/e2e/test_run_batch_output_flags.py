"""vLLM's ``--return-tokens-as-token-ids`` and ``--enable-log-outputs`` in ``kvflow run-batch``
(vLLM's run-batch takes its server's frontend flags): a completions line's logprobs tokens
are ``token_id:N`` (the generated ids), and each line's output is logged with its text."""

from __future__ import annotations

import json

from tests.e2e.test_run_batch import CMPL, MODEL, _args, _envelope


def test_token_ids_and_output_log(tiny_chat_model, tmp_path, run_batch_here):
    body = {"model": MODEL, "prompt": "the quick", "max_tokens": 3, "temperature": 0,
            "logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    out = tmp_path / "out.jsonl"
    proc = run_batch_here([*_args(tiny_chat_model, out), "--return-tokens-as-token-ids",
                           "--enable-log-requests", "--enable-log-outputs"],
                          _envelope("a", CMPL, body) + "\n", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    choice = json.loads(out.read_text(encoding="utf-8"))["response"]["body"]["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    logged = [x for x in proc.stderr.splitlines() if "Generated response cmpl-" in x]
    assert len(logged) == 1, proc.stderr[-2000:]
    assert logged[0].endswith(f"output: {choice['text']!r}, finish_reason: length")
