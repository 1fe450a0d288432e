"""Platform plugins: a package registers a Platform under the ``kvflow.platform_plugins``
entry point group and ``--device <name>`` runs the engine on it.

The test writes a tiny installed package (module + ``.dist-info`` with ``entry_points.txt``)
into a temporary folder and puts it on ``sys.path``; ``importlib.metadata`` discovers it as it
would any installed distribution. Its platform runs on CPU tensors with its own attention
backend (kvflow's torch backend, counting its calls), so the tiny model's greedy tokens must
equal a CPU engine's on the torch backend, and the plugin's backend must have run.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kvflow import LLM, SamplingParams, platforms

PLUGIN = textwrap.dedent('''
    """A fake accelerator for kvflow's tests: CPU tensors, its own attention backend."""
    import torch

    from kvflow.attention.torch_paged import TorchPagedAttentionBackend
    from kvflow.platforms import Platform


    class CountingBackend(TorchPagedAttentionBackend):
        name = "fake-attention"
        calls = 0

        def forward(self, *args, **kwargs):
            type(self).calls += 1
            return super().forward(*args, **kwargs)


    class FakePlatform(Platform):
        name = "fakedev"
        device_type = "cpu"  # its tensors are CPU tensors: ops dispatch to forward_cpu
        default_attention_backend = "fake-attention"
        default_kv_cache_bytes = 64 * 2**20

        @property
        def device(self):
            return torch.device("cpu")

        def default_dtype(self):
            return torch.float32

        def memory_info(self):
            return 8 * 2**30, 16 * 2**30

        def get_attention_backend(self, name):
            return CountingBackend() if name == "fake-attention" else None


    def absent():
        return None  # a plugin whose device is not present on this machine
''')
ENTRY_POINTS = """[kvflow.platform_plugins]
fakedev = kvflow_fake_platform:FakePlatform
absentdev = kvflow_fake_platform:absent
brokendev = kvflow_fake_platform:no_such_name
"""


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    """The fake plugin installed in a folder on sys.path (and the plugin cache cleared)."""
    site = tmp_path / "site"
    (site / "kvflow_fake_platform").mkdir(parents=True)
    (site / "kvflow_fake_platform" / "__init__.py").write_text(PLUGIN)
    info = site / "kvflow_fake_platform-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvflow-fake-platform\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    platforms.plugin_platforms.cache_clear()
    yield site
    platforms.plugin_platforms.cache_clear()
    sys.modules.pop("kvflow_fake_platform", None)


def test_entry_points_are_discovered(plugin_site, caplog):
    with caplog.at_level(logging.ERROR, logger="kvflow.platforms"):
        found = platforms.plugin_platforms()
    assert [p.name for p in found] == ["fakedev"]  # absent skipped, broken logged
    assert "brokendev" in caplog.text
    assert platforms.available_devices() == ["auto", "cpu", "cuda", "fakedev"]
    assert platforms.get_platform("fakedev").name == "fakedev"
    assert platforms.op_dispatch_key("cpu") == "cpu"  # built-ins own their device types
    with pytest.raises(ValueError, match="fakedev"):  # the error lists the plugin
        platforms.get_platform("tpu")


def test_tiny_model_runs_on_the_plugin_platform(plugin_site, tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["the quick brown fox", "kvflow pages keys"]
    reference = LLM(model=tiny_llama.path, device="cpu", dtype="float32",
                    attention_backend="torch", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params,
                                                                    use_tqdm=False)]
    llm = LLM(model=tiny_llama.path, device="fakedev", dtype="float32")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    core = llm.engine.core
    assert core.platform.name == "fakedev"
    backend = core.executor.runner.attn_ctx.backend
    assert type(backend).__name__ == "CountingBackend" and type(backend).calls > 0
    # the plugin's KV budget, 64 MiB, in blocks of 16 tokens of K and V in every layer (fp32)
    cfg = tiny_llama.hf_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block = cfg.num_hidden_layers * 2 * 16 * cfg.num_key_value_heads * head_dim * 4
    assert core.num_blocks == 64 * 2**20 // block


def test_device_flag_selects_the_plugin_in_a_new_process(plugin_site, tiny_llama):
    """``kvflow generate --device fakedev`` in a fresh interpreter: discovery through the
    installed package alone."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(plugin_site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cmd = [sys.executable, "-m", "kvflow", "generate", "--model", tiny_llama.path, "--device",
           "fakedev", "--dtype", "float32", "--prompt", "the quick brown fox",
           "--max-tokens", "4", "--temperature", "0"]
    # both processes at once (each mostly imports, on one core)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done, bad = pool.map(lambda c: subprocess.run(c, check=False, env=env,
                                                      capture_output=True, text=True,
                                                      timeout=300),
                             [cmd, cmd[:7] + ["nodev"] + cmd[8:]])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert bad.returncode == 2
    assert "unknown device 'nodev'" in bad.stderr and "fakedev" in bad.stderr
