"""vLLM's ``--tokenizer-revision`` and ``--hf-token`` on Hub models, offline, from a cache laid
out as huggingface_hub lays it out (``hub_cache`` of tests/models/test_hf_hub.py: main -> the
tiny Llama, tag v1 -> the tiny Qwen2): the tokenizer is read from the snapshot of the revision
asked for while the weights stay the model's (greedy tokens equal transformers'), and every
Hub download (model, tokenizer) is given the token."""

from __future__ import annotations

import pytest

from kvflow import LLM, SamplingParams
from kvflow.config import EngineConfig
from kvflow.config.model import ModelConfig
from kvflow.entrypoints.cli import build_parser
from kvflow.models.tokenizer_source import tokenizer_source
from tests.models.test_hf_hub import COMMIT_A, COMMIT_B, PROMPT, hf_greedy_tokens, hub_cache

__all__ = ["hub_cache"]  # the module-scoped fixture, used here too


def _llm(cache, **kw) -> LLM:
    return LLM(model="kvflow-test/tiny", download_dir=str(cache), dtype="float32",
               num_kv_blocks=64, block_size=4, **kw)


def test_tokenizer_from_its_revision(hub_cache, tiny_model_factory):
    snapshots = hub_cache / "models--kvflow-test--tiny" / "snapshots"
    assert _llm(hub_cache).get_tokenizer().name_or_path == str(snapshots / COMMIT_A)
    llm = _llm(hub_cache, tokenizer_revision="v1")
    assert llm.get_tokenizer().name_or_path == str(snapshots / COMMIT_B)
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)
    # the weights are main's (the Llama), only the tokenizer came from v1
    assert out.outputs[0].token_ids == hf_greedy_tokens(tiny_model_factory("llama"), PROMPT, 6)


@pytest.mark.parametrize("kwargs,needle", [
    ({"model": "SmolLM2-135M-Instruct", "tokenizer_revision": "v1"},
     "applies to Hugging Face repo ids only, and model 'SmolLM2-135M-Instruct'"),
    ({"model": "o/m", "tokenizer": "o/t@v2", "tokenizer_revision": "v1"},
     "names revision 'v2' but tokenizer_revision='v1'"),
    ({"model": "o/m", "tokenizer_revision": "v1", "skip_tokenizer_init": True},
     "no tokenizer is loaded"),
    ({"model": "o/m", "hf_token": " "}, "hf_token is empty"),
])
def test_refused(kwargs, needle):
    """The Hub checks when the tokenizer's source is chosen (before any load), the others
    when the config is built."""
    with pytest.raises(ValueError, match=needle):
        tokenizer_source(ModelConfig(**kwargs))


def test_tokenizer_source():
    assert tokenizer_source(ModelConfig(model="o/m@r1")) is None
    assert tokenizer_source(ModelConfig(model="o/m@r1", tokenizer_revision="v1")) == "o/m@v1"
    assert tokenizer_source(ModelConfig(model="o/m", tokenizer="o/t",
                                        tokenizer_revision="v1")) == "o/t@v1"


def test_token_reaches_every_download(hub_cache, monkeypatch):
    import huggingface_hub

    tokens = []
    real = huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: tokens.append((a[0], k.get("token"))) or real(*a, **k))
    llm = _llm(hub_cache, tokenizer="kvflow-test/tok", hf_token="hf_secret")
    assert llm.get_tokenizer().encode("hi")
    assert {repo for repo, _ in tokens} == {"kvflow-test/tiny", "kvflow-test/tok"}
    assert all(token == "hf_secret" for _, token in tokens), tokens


def test_cli():
    parser = build_parser()

    def model_config(*argv: str) -> ModelConfig:
        return EngineConfig.from_cli_args(parser.parse_args(["serve", *argv])).model_config
    assert model_config("--model", "o/m", "--hf-token").hf_token is True  # the stored token
    mc = model_config("--model", "o/m", "--hf-token", "hf_x", "--tokenizer-revision", "v2")
    assert (mc.hf_token, mc.tokenizer_revision, tokenizer_source(mc)) == ("hf_x", "v2", "o/m@v2")
    assert model_config("--model", "o/m").hf_token is None


def test_server_info_masks_the_token():
    """/server_info (KVFLOW_SERVER_DEV_MODE=1) shows the engine config: a token given is
    masked there as the API key is."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from kvflow.config import ServerConfig
    from kvflow.entrypoints.api_server import build_app

    config = ServerConfig.from_cli_args(build_parser().parse_args(["serve"]),
                                        env={"KVFLOW_SERVER_DEV_MODE": "1"})
    for token, shown in (("hf_secret", "***"), (True, True), (None, None)):
        engine = SimpleNamespace(config=EngineConfig.from_kwargs(model="o/m", hf_token=token),
                                 is_healthy=True, dead_error=None, task="generate",
                                 processor=SimpleNamespace(pooler=None))
        info = TestClient(build_app(engine, config, "m")).get("/server_info").json()
        assert info["engine_config"]["model_config"]["hf_token"] == shown
        assert "hf_secret" not in str(info)


def test_config_file(tmp_path):
    """YAML true is the flag alone (the stored token), false leaves it unset, as vLLM's config
    file reads booleans; text is the token (was: true read as the token 'true')."""
    from kvflow.entrypoints.config_file import expand_config_file

    parser = build_parser()
    path = tmp_path / "serve.yaml"
    for text, token in (("true", True), ("false", None), ("hf_abc", "hf_abc")):
        path.write_text(f"model: o/m\nhf-token: {text}\ntokenizer_revision: v3\n")
        args = parser.parse_args(expand_config_file(parser, ["serve", "--config", str(path)]))
        mc = EngineConfig.from_cli_args(args).model_config
        assert (mc.hf_token, tokenizer_source(mc)) == (token, "o/m@v3")
