"""DeepSeek-V3's MTP layer as a speculative head (``{"method": "deepseek_mtp"}``), on the tiny
DeepSeek-V3 with an MTP layer added to its checkpoint (``model.layers.2.*``: random enorm,
hnorm, eh_proj, shared_head.norm; the decoder block a copy of layer 1's MLA + MoE tensors;
the embedding / head copies the target's).

Oracles: transformers' own layer 1 (the block's weights) run as the MTP block in plain torch
around it, fed transformers' final hidden states, gives the engine's draft tokens; greedy
output equals plain greedy output; the acceptance counters equal the confirmed prefixes.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvflow import LLM, SamplingParams
from tests.spec_decode.head_reference import expected_counts, ref_rollout
from tests.spec_decode.test_eagle_engine import _record_proposals, _rms
from tests.spec_decode.test_ngram_engine import PROMPTS, _drafted, _same_outputs


def _add_mtp_layer(target, folder) -> dict[str, torch.Tensor]:
    """Copy the target's folder to ``folder`` with an MTP layer at index num_hidden_layers;
    returns the MTP layer's own tensors (enorm, hnorm, eh_proj, shared_head.norm)."""
    shutil.copytree(target.path, folder)
    config = json.loads((folder / "config.json").read_text())
    n, h = config["num_hidden_layers"], config["hidden_size"]
    tensors = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    own = {"enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "eh_proj.weight": 0.1 * torch.randn(h, 2 * h, generator=g),
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)}
    extra = {f"model.layers.{n}.{k}": v for k, v in own.items()}
    prefix = f"model.layers.{n - 1}."
    extra.update({f"model.layers.{n}.{k[len(prefix):]}": v.clone()
                  for k, v in tensors.items() if k.startswith(prefix)})
    extra[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, str(folder / "model.safetensors"))
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return own


def _ref_drafts(hf_model, own: dict, context: list[int], k: int) -> list[int]:
    """The MTP layer's k greedy drafts after ``context`` (``_ref_logits``)."""
    return _ref_logits(hf_model, own, context, k)[0]


def _ref_logits(hf_model, own: dict, context: list[int], k: int,
                given: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """The MTP layer's k drafts after ``context`` (x[0..n]; the argmax, or ``given[i]``) and
    their logits [k, V]: positions 0..n-1 take
    x[p+1] (embedding zeroed at position 0) and transformers' final hidden state f[p]; the
    block is transformers' layer 1 itself (the MTP block's weights), causal over the
    sequence; its output is fed back for the next draft."""
    cfg = hf_model.config
    eps = cfg.rms_norm_eps
    block = hf_model.model.layers[cfg.num_hidden_layers - 1]
    embed = hf_model.get_input_embeddings().weight
    lm_head = hf_model.get_output_embeddings().weight
    with torch.no_grad():
        feats = hf_model(torch.tensor([context[:-1]]),
                         output_hidden_states=True).hidden_states[-1][0]

    def block_pass(ids: list[int], feats: torch.Tensor) -> torch.Tensor:
        t = len(ids)
        pos = torch.arange(t)
        e = embed[ids] * (pos != 0).float()[:, None]
        x = torch.cat([_rms(e, own["enorm.weight"], eps),
                       _rms(feats, own["hnorm.weight"], eps)], -1) @ own["eh_proj.weight"].T
        rope = hf_model.model.rotary_emb(x[None], pos[None])
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = block(x[None], attention_mask=mask, position_ids=pos[None],
                    position_embeddings=rope)
        return (out[0] if isinstance(out, tuple) else out)[0]

    def readout(last: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits = _rms(last, own["shared_head.norm.weight"], eps) @ lm_head.T
        return logits, int(logits.argmax())

    return ref_rollout(block_pass, readout, context, feats, k, given)


@pytest.fixture(scope="module")
def mtp(tiny_model_factory, tmp_path_factory):
    target = tiny_model_factory("deepseek_v3")
    folder = tmp_path_factory.mktemp("mtp") / "model"
    own = _add_mtp_layer(target, folder)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "adaptive": False}
    return (target, own, LLM(model=str(folder), dtype="float32", block_size=4,
                             num_kv_blocks=96),
            LLM(model=str(folder), dtype="float32", block_size=4, num_kv_blocks=96,
                speculative_config=spec))


def test_drafts_match_transformers_layer_as_the_mtp_block(mtp, monkeypatch):
    target, own, _, spec = mtp
    assert spec.engine.core.config.speculative_config.model == \
        spec.engine.core.config.model_config.model  # defaults to the target
    seen = _record_proposals(monkeypatch)
    spec.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                  use_tqdm=False)
    assert len(seen) >= 4
    for context, drafts, _ in seen:
        assert drafts == _ref_drafts(target.hf_model, own, context, len(drafts))


def test_sampled_draft_distributions_match_the_reference(mtp, monkeypatch):
    target, own, _, spec = mtp
    seen = _record_proposals(monkeypatch)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True)
              for s in range(len(PROMPTS))]
    spec.generate(PROMPTS, params, use_tqdm=False)
    assert len(seen) >= 8
    for context, drafts, q in seen:
        _, logits = _ref_logits(target.hf_model, own, context, len(drafts), drafts)
        torch.testing.assert_close(q, logits.softmax(-1), atol=2e-5, rtol=1e-3)


def test_greedy_equals_plain_greedy(mtp, monkeypatch, assert_no_leaks):
    _, _, base, spec = mtp
    seen = _record_proposals(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = base.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    _same_outputs(ref, got)
    drafted, accepted = expected_counts(seen, got)
    assert _drafted(got) == (drafted, accepted) and drafted > 0
    assert_no_leaks(spec)


def test_a_checkpoint_without_mtp_layers_is_refused(tiny_model_factory):
    target = tiny_model_factory("deepseek_v3")
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(model=target.path, dtype="float32", block_size=4, num_kv_blocks=32,
            speculative_config={"method": "deepseek_mtp"})
