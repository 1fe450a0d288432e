"""``kvflow bench perplexity`` on a tiny Llama against the same perplexity computed from HF
transformers' logits, window by window; and the greedy-agreement rule by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvflow.bench.perplexity import DEFAULT_TEXT, greedy_agreement, scoring_window, windows
from kvflow.entrypoints.cli import main


def test_windows_and_agreement():
    assert windows(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5]]  # [6] scores nothing
    assert windows(list(range(8)), 3)[-1] == [6, 7]
    assert greedy_agreement([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == pytest.approx(0.8)


def test_perplexity_matches_hf(tiny_llama, tmp_path):
    text = "the quick brown fox jumps over a lazy dog while kvflow pages keys " * 6
    text_file = tmp_path / "text.txt"
    text_file.write_text(text)
    out = tmp_path / "ppl.json"
    assert main(["bench", "perplexity", "--model", tiny_llama.path, "--dtype", "float32",
                 "--text-file", str(text_file), "--window", "24", "--num-kv-blocks", "64",
                 "--num-greedy-prompts", "2", "--greedy-tokens", "4",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama.path).encode(text)
    total, count = 0.0, 0
    for chunk in windows(ids, 24):
        with torch.no_grad():
            lp = torch.log_softmax(tiny_llama.hf_model(torch.tensor([chunk])).logits[0, :-1],
                                   dim=-1)
        total += float(lp.gather(1, torch.tensor(chunk[1:])[:, None]).sum())
        count += len(chunk) - 1
    assert result["scored_tokens"] == count
    assert result["perplexity"] == pytest.approx(math.exp(-total / count), rel=1e-4)
    assert result["weight_bytes"] > 0 and result["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 4
    assert len(result["greedy"]) == 2 and all(len(g) == 4 for g in result["greedy"])
    again = tmp_path / "again.json"
    assert main(["bench", "perplexity", "--model", tiny_llama.path, "--dtype", "float32",
                 "--text-file", str(text_file), "--window", "24", "--num-kv-blocks", "64",
                 "--num-greedy-prompts", "2", "--greedy-tokens", "4", "--quantization", "int8",
                 "--compare", str(out), "--output-json", str(again)]) == 0
    compared = json.loads(again.read_text())
    assert compared["perplexity_ratio"] == pytest.approx(compared["perplexity"]
                                                         / result["perplexity"])
    assert 0.0 <= compared["greedy_agreement"] <= 1.0


def test_default_text_is_shipped():
    assert DEFAULT_TEXT.is_file() and len(DEFAULT_TEXT.read_text()) > 15000


def _input_files(tmp_path) -> dict[str, str]:
    files = {"empty.txt": b"", "blank.txt": b" \n\t\n", "binary.txt": b"\x89PNG\r\n\x1a\n\xff\x00",
             "bad.json": b"{not json", "list.json": b"[1, 2]",
             "other.json": b'{"perplexity": "high", "greedy": []}'}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "folder.txt").mkdir()
    return {name: str(tmp_path / name) for name in [*files, "folder.txt"]}


@pytest.mark.parametrize("flag, name, why", [
    ("--text-file", "/nonexistent.txt", "cannot read it (No such file or directory)"),
    ("--text-file", "folder.txt", "cannot read it (Is a directory)"),
    ("--text-file", "empty.txt", "the file is empty"),
    ("--text-file", "blank.txt", "the file is empty"),
    ("--text-file", "binary.txt", "not UTF-8 text (byte 0: invalid start byte)"),
    ("--compare", "/nonexistent.json", "cannot read it (No such file or directory)"),
    ("--compare", "binary.txt", "not UTF-8 text"),
    ("--compare", "bad.json", "not JSON"),
    ("--compare", "list.json", "not a kvflow bench perplexity --output-json result"),
    ("--compare", "other.json", "not a kvflow bench perplexity --output-json result"),
])
def test_bad_input_files_are_one_line_before_loading(tmp_path, capsys, flag, name, why):
    """The model does not exist: each file is refused, naming the flag and the file, before
    it would be loaded."""
    path = _input_files(tmp_path).get(name, name)
    rc = main(["bench", "perplexity", "--model", "/nonexistent/model", flag, path])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvflow: error: {flag} {path}: {why}"), lines[0]


def test_text_of_one_token_is_one_line(tiny_llama, tmp_path, capsys):
    """Nothing to score (a window needs 2 tokens): one line, not a ZeroDivisionError."""
    text_file = tmp_path / "one.txt"
    text_file.write_text("a")
    rc = main(["bench", "perplexity", "--model", tiny_llama.path, "--dtype", "float32",
               "--num-kv-blocks", "16", "--text-file", str(text_file)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    expected = (f"kvflow: error: --text-file {text_file} has 1 token(s): at least 2 are needed "
                "to score one")
    assert rc == 2 and lines == [expected]


@pytest.mark.parametrize("count", ["-1", "-2"])
def test_negative_greedy_prompts_is_one_line_before_loading(capsys, count):
    """0 means no greedy check; a negative count was run: -1 ended in a ZeroDivisionError
    traceback after the model had loaded and the text had been scored."""
    rc = main(["bench", "perplexity", "--model", "/nonexistent/model",
               "--num-greedy-prompts", count])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0] == (f"kvflow: error: --num-greedy-prompts must be >= 0 (0: no greedy "
                        f"check), got {count}"), lines[0]


def test_scoring_window_is_refused_above_max_model_len_and_default_is_capped():
    assert scoring_window(None, 8192) == 512      # the default, within the context
    assert scoring_window(None, 100) == 100       # the default, capped by a short context
    assert scoring_window(8192, 8192) == 8192     # exactly the limit is allowed
    with pytest.raises(ValueError) as err:
        scoring_window(100000, 8192)
    assert str(err.value) == ("--window 100000 exceeds the engine's max_model_len 8192: give "
                              "--window 8192 or less")


def test_window_above_max_model_len_is_one_line(tiny_llama, tmp_path, capsys):
    """--window 100000 was silently scored in windows of max_model_len."""
    config = json.loads((Path(tiny_llama.path) / "config.json").read_text())
    positions = config["max_position_embeddings"]  # the model's context, from its own file
    text_file = tmp_path / "text.txt"
    text_file.write_text("the quick brown fox " * 8)
    blocks = positions // 16 + 2  # KV room for a whole context: the limit is the model's
    rc = main(["bench", "perplexity", "--model", tiny_llama.path, "--dtype", "float32",
               "--num-kv-blocks", str(blocks), "--block-size", "16",
               "--text-file", str(text_file), "--window", "100000"])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    expected = (f"kvflow: error: --window 100000 exceeds the engine's max_model_len "
                f"{positions}: give --window {positions} or less")
    assert rc == 2 and lines == [expected], lines
