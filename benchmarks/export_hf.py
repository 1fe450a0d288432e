"""Export a packaged GGUF model (default SmolLM2-135M-Instruct) as a Hugging Face folder
(config.json + bf16 safetensors + tokenizer with its chat template), for peer engines that only
load HF folders (vLLM CPU, ``transformers serve``).

transformers loads a GGUF (dequantized) but refuses to ``save_pretrained`` a GGUF-loaded model,
so: drop ``config.quantization_config``, build a fresh model with ``from_config``,
``load_state_dict`` the loaded weights into it, and save that (bf16, the GGUF's own precision;
engines that want fp32 load it with ``--dtype float32``).

    .venv/bin/python benchmarks/export_hf.py OUT_DIR [--model SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import os

import torch


def export(model: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write the HF folder of ``model`` (packaged name or .gguf path) to ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvflow.models.model_resolver import resolve_model

    source = resolve_model(model)
    if source.kind != "gguf":
        raise SystemExit(f"{model} is already an HF folder: {source.path}")
    folder, name = os.path.split(source.path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=dtype)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    export(args.model, args.out_dir)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
