"""``kvflow generate --image FILE`` on the tiny Qwen2-VL: the printed completion is the text of
transformers' greedy tokens for the same prompt and image (plain prompt with a placeholder, and
--chat, rendered by the HF processor's chat template); a missing file is one error line."""

from __future__ import annotations

from kvflow.entrypoints.cli import main
from tests.multimodal.conftest import PLACEHOLDER, hf_generate, png_bytes, random_image

ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--temperature", "0", "--max-tokens",
        "6", "--ignore-eos"]


def test_generate_with_image_files(tiny_qwen2_vl, tmp_path, capsys):
    image = random_image(98, 70, 41)
    path = tmp_path / "cat.png"
    path.write_bytes(png_bytes(image))
    tok = tiny_qwen2_vl.tokenizer
    prompt = f"a {PLACEHOLDER} is"
    assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", prompt, "--image",
                 str(path), *ARGS]) == 0
    want = tok.decode(hf_generate(tiny_qwen2_vl, prompt, [image], 6))
    assert capsys.readouterr().out.rstrip("\n") == prompt + want
    text = tiny_qwen2_vl.processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}],
        add_generation_prompt=True, tokenize=False)
    misnamed = tmp_path / "cat.tif"  # a PNG under a name that says TIFF: the bytes decide
    misnamed.write_bytes(png_bytes(image))
    for file in (path, misnamed):
        assert main(["generate", "--model", tiny_qwen2_vl.path, "--chat", "--prompt", "what?",
                     "--image", str(file), *ARGS]) == 0
        assert capsys.readouterr().out.rstrip("\n") == \
            tok.decode(hf_generate(tiny_qwen2_vl, text, [image], 6))


def test_missing_or_bad_image_file_is_one_error_line(tiny_qwen2_vl, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    for path, words in ((tmp_path / "nope.png", "cannot read it"), (bad, "cannot decode")):
        assert main(["generate", "--model", tiny_qwen2_vl.path, "--prompt", PLACEHOLDER,
                     "--image", str(path), *ARGS]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvflow: error: --image {path}") and words in err


def test_an_image_the_model_cannot_take_names_its_file(tiny_qwen2_vl, tmp_path, capsys):
    """A 1x1 image passes the file checks and is refused by the model's processor (each side
    at least one 14-pixel patch): its error lacked the ``--image FILE:`` prefix the other
    --image errors have."""
    good, tiny = tmp_path / "good.png", tmp_path / "tiny.png"
    random_image(28, 28, 0).save(good)
    random_image(1, 1, 0).save(tiny)
    for prompt in (["--prompt", f"{PLACEHOLDER} {PLACEHOLDER}"], ["--chat", "--prompt", "?"]):
        assert main(["generate", "--model", tiny_qwen2_vl.path, *prompt, "--image", str(good),
                     "--image", str(tiny), *ARGS]) == 2
        assert capsys.readouterr().err == (f"kvflow: error: --image {tiny}: the image is 1 x "
                                           "1 pixels; each side must be at least 14 pixels "
                                           "(one vision patch)\n")
