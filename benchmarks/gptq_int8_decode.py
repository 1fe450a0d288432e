"""Batch-1 decode ms/token of a group-wise 8-bit GPTQ model (Qwen's ``*-GPTQ-Int8`` layout) on
CPU: group scales inside kvflow's native INT8 GEMM against the path it replaced (one INT8
product per group of columns, summed by torch), beside the unquantized model.

    python benchmarks/gptq_int8_decode.py --model out/smollm2-hf --group 64 --rounds 3

The model's linears (q/k/v/o, gate/up/down) are quantized here, symmetric absmax per group of
``--group`` input columns (``q = round(w / s) + 128``, ``s = absmax / 127``), and written as
AutoGPTQ does (``qweight`` int32 [K/4, N], ``qzeros`` [G, N/4] holding ``zero - 1`` = 127,
``scales`` fp16 [G, N], ``g_idx``), into a temporary folder. Variants, all loaded in one
process and timed in turn each round (a load spike of the shared machine hits all alike),
medians reported:

* ``unquantized``: the model as given, ``--dtype``;
* ``per-group`` (before): the GPTQ folder with ``PackedInt8Method.apply_cpu`` set back to the
  old loop (a native INT8 product per group, ``x[:, g]`` against ``q[:, g]`` with that group's
  scale, the parts added by torch; its step graphs are refused by the additions);
* ``grouped`` (after): the GPTQ folder as kvflow runs it (``kvflow_int8_gemm_grouped``);
* ``torch``: the GPTQ folder with ``KVFLOW_CPU_QUANT=torch`` (the weight dequantized per call).

ms/token = (end-to-end - TTFT) / (tokens - 1) of one 32-token prompt, ``--tokens`` greedy
tokens (EOS ignored), from the request's own metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile

import torch

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack_rows(u: torch.Tensor) -> torch.Tensor:
    """uint8 values int64 [K, N] -> int32 [K / 4, N]: row 4i + j at bits 8j of word i."""
    u = u.view(-1, 4, u.shape[1])
    words = sum(u[:, j] << (8 * j) for j in range(4))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def write_gptq_int8(src: str, dst: str, group: int) -> None:
    """``src``'s HF folder with every decoder linear as symmetric 8-bit GPTQ of ``group``."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{src}/model.safetensors")
    out = {}
    for name, w in tensors.items():
        if not name.endswith(tuple(f"{p}.weight" for p in _LINEARS)):
            out[name] = w
            continue
        base = name[:-len(".weight")]
        w = w.float()
        n, k = w.shape
        g = w.view(n, k // group, group)
        s = (g.abs().amax(-1) / 127).clamp(min=1e-8).half().float()  # [N, G], as stored
        u = (torch.round(g / s[..., None]).clamp(-127, 127) + 128).to(torch.int64).view(n, k)
        out[f"{base}.qweight"] = _pack_rows(u.t().contiguous())
        zeros = torch.full((k // group, n), 127, dtype=torch.int64)  # zero 128, stored - 1
        out[f"{base}.qzeros"] = _pack_rows(zeros.t().contiguous()).t().contiguous()
        out[f"{base}.scales"] = s.t().half().contiguous()
        out[f"{base}.g_idx"] = (torch.arange(k) // group).to(torch.int32)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(out, f"{dst}/model.safetensors")
    with open(f"{dst}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": group,
                                     "sym": True, "desc_act": False,
                                     "checkpoint_format": "gptq"}
    with open(f"{dst}/config.json", "w") as f:
        json.dump(config, f)


def _per_group_apply_cpu(self, layer, x, bias):
    """The replaced path (kvflow before the grouped kernel): one INT8 product per group."""
    from kvflow.quant.int8 import int8_linear, native_int8_kernels

    if layer.weight_scale.dim() == 1:
        return _GROUPED_APPLY(self, layer, x, bias)
    if native_int8_kernels(x) is None:
        return self.apply_native(layer, x, bias)
    g = self.ckpt_group
    y = None
    for i in range(layer.weight_scale.shape[1]):
        part = int8_linear(x[..., i * g:(i + 1) * g], layer.weight[:, i * g:(i + 1) * g],
                           layer.weight_scale[:, i].contiguous())
        y = part if y is None else y + part
    return y if bias is None else y + bias.to(x.dtype)


_GROUPED_APPLY = None


def activate(name: str) -> None:
    """Put the process in variant ``name``'s mode (the INT8 path and the kernel choice)."""
    from kvflow.quant.pack_quantized import PackedInt8Method

    PackedInt8Method.apply_cpu = _per_group_apply_cpu if name == "per-group" \
        else _GROUPED_APPLY
    os.environ["KVFLOW_CPU_QUANT"] = "torch" if name == "torch" else "native"


def decode_ms_per_token(llm, prompt: list[int], tokens: int) -> float:
    from kvflow import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    m = out.metrics
    return (m.e2e_latency - m.ttft) / (len(out.outputs[0].token_ids) - 1) * 1e3


def main() -> None:
    global _GROUPED_APPLY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="out/smollm2-hf")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--variants", default="unquantized,per-group,grouped,torch")
    args = parser.parse_args()
    from kvflow import LLM
    from kvflow.quant.pack_quantized import PackedInt8Method

    _GROUPED_APPLY = PackedInt8Method.apply_cpu
    names = args.variants.split(",")
    prompt = list(range(100, 132))
    with tempfile.TemporaryDirectory() as tmp:
        folder = f"{tmp}/gptq-int8-g{args.group}"
        write_gptq_int8(args.model, folder, args.group)
        engines = {}
        for name in names:
            activate(name)
            engines[name] = LLM(model=args.model if name == "unquantized" else folder,
                                dtype=args.dtype, kv_cache_memory="256MiB",
                                enable_prefix_caching=False)
            decode_ms_per_token(engines[name], prompt, 4)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names:
                activate(name)
                times[name].append(decode_ms_per_token(engines[name], prompt, args.tokens))
                print(f"round {r}: {name} {times[name][-1]:.2f} ms/token", flush=True)
    print(f"\n{args.model} GPTQ 8-bit group {args.group}, {args.dtype}, batch 1, "
          f"{args.tokens} tokens, load average {os.getloadavg()}")
    med = {name: statistics.median(t) for name, t in times.items()}
    for name in names:
        print(f"{name:12s} {med[name]:8.2f} ms/token")
    if "per-group" in med and "grouped" in med:
        print(f"before/after (per-group / grouped): x{med['per-group'] / med['grouped']:.1f}")


if __name__ == "__main__":
    main()
