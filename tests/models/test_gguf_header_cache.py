"""A process parses a GGUF file's header once (``read_gguf_metadata``): the engine core read it
for the config and again for the weights, the API process of ``kvflow serve`` three times
(config, tokenizer, EOS ids), 1.4 s a parse of SmolLM2-135M's on 2 busy cores. A file
rewritten in place is parsed again. Oracle: ``gguf.GGUFReader``'s values and a count of the
parser's calls."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvflow.models import gguf_reader
from kvflow.models.gguf_config import load_gguf_config
from kvflow.models.gguf_loader import iter_gguf_weights
from kvflow.models.gguf_reader import read_gguf_metadata

gguf = pytest.importorskip("gguf")

from tests.models.test_gguf_loader import _synthetic


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The paths ``_parse_header`` runs for during the test (the cache emptied first)."""
    seen: list[str] = []
    parse = gguf_reader._parse_header

    def counting(path, buf, size):
        seen.append(path)
        return parse(path, buf, size)

    monkeypatch.setattr(gguf_reader, "_parse_header", counting)
    _forget_headers()
    yield seen
    _forget_headers()


def _forget_headers() -> None:
    """Empty the process's header cache (none before it existed)."""
    cached = getattr(gguf_reader, "_read_header", None)
    if cached is not None:
        cached.cache_clear()


def test_config_and_weights_parse_the_header_once(tmp_path, parses):
    path, expected = _synthetic(tmp_path, "llama", permute=True)
    cfg = load_gguf_config(path)
    weights = dict(iter_gguf_weights(path, torch.float32))
    assert parses == [path]  # before: [path, path]
    assert cfg.num_hidden_layers == 2 and cfg.hidden_size == 16
    assert torch.equal(weights["model.norm.weight"], torch.from_numpy(expected["model.norm.weight"]))
    assert read_gguf_metadata(path) is read_gguf_metadata(path)
    assert parses == [path]


def test_a_rewritten_file_is_parsed_again(tmp_path, parses):
    path, _ = _synthetic(tmp_path, "llama")
    first = read_gguf_metadata(path)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(path + ".new", "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = 3 if field.name == "llama.block_count" else field.contents()
        writer.add_key_value(field.name, value, field.types[0],
                             sub_type=field.types[1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".new", path)
    second = read_gguf_metadata(path)
    assert parses == [path, path]
    assert first.get("llama.block_count") == 2
    assert second.get("llama.block_count") == gguf.GGUFReader(path).fields[
        "llama.block_count"].contents() == 3


def test_a_bad_file_is_refused_every_time(tmp_path, parses):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x01")  # header cut short
    for _ in range(2):
        with pytest.raises(ValueError, match="not a valid GGUF file"):
            read_gguf_metadata(str(path))
    assert parses == [str(path), str(path)]  # errors are not kept
