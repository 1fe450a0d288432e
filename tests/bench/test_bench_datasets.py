"""Arrival processes and benchmark datasets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvflow.bench.datasets import (
    LengthDist,
    arrival_intervals,
    load_jsonl,
    parse_length_dist,
    random_requests,
    synthetic_chat_requests,
)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_mean_and_spread(burstiness):
    gaps = arrival_intervals(20000, rate=4.0, burstiness=burstiness, seed=0)
    assert gaps.shape == (20000,) and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.05)  # mean gap = 1 / rate
    # a gamma of shape k has coefficient of variation 1 / sqrt(k) (1 for Poisson)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.08)


def test_poisson_counts_per_second():
    arrivals = np.cumsum(arrival_intervals(40000, rate=8.0, burstiness=1.0, seed=1))
    counts = np.bincount(arrivals.astype(int))[:-1]  # drop the partial last second
    assert counts.mean() == pytest.approx(8.0, rel=0.05)
    assert counts.var() == pytest.approx(8.0, rel=0.15)  # Poisson: variance == mean


@pytest.mark.parametrize("n, rate, burstiness", [(64, 4.0, 1.0), (10, 0.5, 0.25), (1, 2.0, 3.0)])
def test_arrivals_offer_exactly_the_rate(n, rate, burstiness):
    # vLLM's serving benchmark scales the gaps so the last request goes out at n / rate
    for seed in range(5):
        gaps = arrival_intervals(n, rate, burstiness, seed=seed)
        assert gaps.sum() == pytest.approx(n / rate, rel=1e-12) and (gaps > 0).all()
    raw = np.random.RandomState(0).gamma(burstiness, 1 / (rate * burstiness), n)
    assert arrival_intervals(n, rate, burstiness, seed=0) == pytest.approx(
        raw * (n / rate) / raw.sum())  # the same draws, scaled: the shape is kept


@pytest.mark.parametrize("n, rate, burstiness, seed, vllm_send_times", [
    (5, 2.0, 1.0, 0, [0.46129330003090274, 1.1892377690602984, 1.7243430491324006,
                      2.1806092237818007, 2.5]),
    (4, 0.5, 0.25, 7, [0.0025777180520236698, 2.811031638658477, 7.605242071294953, 8.0])])
def test_arrivals_are_vllms_for_the_same_seed(n, rate, burstiness, seed, vllm_send_times):
    # the send times (s after the start) of vLLM 0.32's get_request (vllm/benchmarks/serve.py)
    # after np.random.seed(seed), as `vllm bench serve --seed` draws them: recorded by running
    # it with asyncio.sleep replaced (was: np.random.default_rng draws, e.g. 0.748, 1.870,
    # 1.892, 1.894, 2.5 for the first case)
    sends = np.cumsum(arrival_intervals(n, rate, burstiness, seed=seed))
    assert sends == pytest.approx(vllm_send_times, rel=1e-12)


def test_arrivals_seeded_inf_and_bad():
    assert (arrival_intervals(5, 2.0, seed=3) == arrival_intervals(5, 2.0, seed=3)).all()
    assert (arrival_intervals(5, float("inf")) == 0).all()
    assert (arrival_intervals(4, 2.0, float("inf")) == 0.5).all()  # vLLM: the limit, even gaps
    for rate, k in ((0.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_intervals(5, rate, k)


def test_random_requests_exact_lengths():
    reqs = random_requests(4, 128, 64, vocab_size=49152, seed=0)
    assert all(len(r.prompt) == r.prompt_len == 128 and r.output_len == 64 for r in reqs)
    ids = np.array([r.prompt for r in reqs])
    assert ids.min() >= 3 and ids.max() < 32000
    # PEERS.md's CPU-W1 draw (unchanged by the range-ratio and prefix options)
    assert (ids == np.random.default_rng(0).integers(3, 32000, (4, 128))).all()


def test_random_range_ratio_and_prefix_are_vllms():
    # vLLM's get_sampling_params: input 10, ratio 0.25 -> [floor(7.5), ceil(12.5)] = [7, 13];
    # output 20 -> [15, 25]; a 3-id prefix shared by every request comes first
    reqs = random_requests(400, 10, 20, vocab_size=100, seed=1, range_ratio=0.25, prefix_len=3)
    body_lens = {r.prompt_len - 3 for r in reqs}
    assert body_lens == set(range(7, 14))
    assert {r.output_len for r in reqs} == set(range(15, 26))
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert len({tuple(r.prompt[:3]) for r in reqs}) == 1
    assert all(3 <= t < 100 for r in reqs for t in r.prompt)
    # the prefix is drawn last: the rest of each prompt is the prefix-less draw's
    plain = random_requests(400, 10, 20, vocab_size=100, seed=1, range_ratio=0.25)
    assert [r.prompt[3:] for r in reqs] == [r.prompt for r in plain]
    # an output length never drops below 1 (vLLM: max(floor(2 * 0.1), 1) = 1 .. ceil(3.8) = 4)
    assert {r.output_len for r in random_requests(300, 20, 2, seed=0, range_ratio=0.9)} == {
        1, 2, 3, 4}
    for bad in ({"range_ratio": 1.0}, {"range_ratio": -0.1}, {"prefix_len": -1}):
        with pytest.raises(ValueError):
            random_requests(2, 10, 5, **bad)
    with pytest.raises(ValueError, match="empty prompt"):  # floor(1 * 0.5) = 0 ids
        random_requests(2, 1, 5, range_ratio=0.5)


def test_synthetic_chat_shares_system_prompts_and_respects_lengths():
    reqs = synthetic_chat_requests(40, num_system_prompts=3,
                                   system_len=LengthDist("uniform", 50, 60),
                                   user_len=LengthDist("uniform", 5, 30),
                                   output_len=LengthDist("normal", 20, 200, mean=40, std=30),
                                   seed=7)
    systems = [r.messages[0]["content"] for r in reqs]
    assert len(set(systems)) == 3  # shared prefixes, each used
    assert all(systems.count(s) >= 13 for s in set(systems))
    for r in reqs:
        system, user = r.messages
        assert system["role"] == "system" and user["role"] == "user"
        assert 50 + 4 <= len(system["content"].split()) <= 60 + 4  # + "You are assistant i."
        assert 5 <= len(user["content"].split()) <= 30
        assert 20 <= r.output_len <= 200
        assert r.prompt.startswith(system["content"])
    assert len({r.messages[1]["content"] for r in reqs}) == 40  # user turns vary
    again = synthetic_chat_requests(40, 3, LengthDist("uniform", 50, 60),
                                    LengthDist("uniform", 5, 30),
                                    LengthDist("normal", 20, 200, mean=40, std=30), seed=7)
    assert again == reqs


def test_length_dists():
    rng = np.random.default_rng(0)
    for spec in ("uniform:3:9", "normal:50:40:10:80", "lognormal:50:40:10:80"):
        dist = parse_length_dist(spec)
        values = dist.sample(rng, 2000)
        assert values.min() >= dist.low and values.max() <= dist.high
    ln = parse_length_dist("lognormal:50:10:1:1000").sample(rng, 20000)
    assert ln.mean() == pytest.approx(50, rel=0.03) and ln.std() == pytest.approx(10, rel=0.1)
    with pytest.raises(ValueError):
        parse_length_dist("normal:1:2")


def test_load_jsonl(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"prompt": "hello"}, {"prompt": [5, 6, 7], "max_tokens": 3}, {},
             {"messages": [{"role": "user", "content": "hi"}], "output_len": 9}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2] + lines[3:]) + "\n\n")
    reqs = load_jsonl(str(path), default_output_len=16)
    assert [r.output_len for r in reqs] == [16, 3, 9]
    assert reqs[1].prompt_len == 3 and reqs[2].messages[0]["content"] == "hi"
    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps(lines[2]) + "\n")
    with pytest.raises(ValueError, match="w.jsonl:2"):
        load_jsonl(str(path), 16)
    # vLLM's custom JSONL names the output length output_tokens (it was ignored: 16 sent)
    path.write_text('{"prompt": "hi", "output_tokens": 7}\n')
    assert load_jsonl(str(path), 16)[0].output_len == 7
    path.write_text('{"prompt": "hi", "output_tokens": 7, "max_tokens": 5}\n')
    with pytest.raises(ValueError, match="w.jsonl:1: give one of max_tokens, output_tokens"):
        load_jsonl(str(path), 16)


@pytest.mark.parametrize("line,why", [
    ("[1, 2]", "JSON object"), ('"text"', "JSON object"), ('{"prompt": 5}', "prompt must"),
    ('{"prompt": ""}', "prompt must"), ('{"prompt": [1, true]}', "prompt must"),
    ('{"prompt": "hi", "output_len": -3}', "positive integer"),
    ('{"prompt": "hi", "max_tokens": 2.5}', "positive integer"),
    ('{"messages": [{"role": "user"}]}', "messages must"), ('{"messages": []}', "messages must"),
    ("{bad json", "w.jsonl:1")])
def test_load_jsonl_rejects_bad_lines(tmp_path, line, why):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match="w.jsonl:1") as info:
        load_jsonl(str(path), 16)
    assert why in str(info.value)


def test_load_jsonl_unreadable_path(tmp_path):
    for path in (tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(ValueError, match="--dataset .*cannot read it"):
            load_jsonl(str(path), 16)


def _decode_data_url(url: str):
    import base64
    import io

    from PIL import Image

    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


@pytest.mark.parametrize("fraction,unique,expected_images,expected_distinct", [
    (0.5, 0, 5, 5), (0.3, 2, 3, 2), (1.0, 3, 10, 3), (0.0, 0, 0, 0)])
def test_random_image_requests(fraction, unique, expected_images, expected_distinct):
    from kvflow.bench.datasets import random_image_requests

    reqs = random_image_requests(10, 7, 5, (40, 30), fraction, unique, seed=1)
    urls = [p["image_url"]["url"] for r in reqs for p in
            (r.messages[0]["content"] if isinstance(r.messages[0]["content"], list) else [])
            if p["type"] == "image_url"]
    assert len(urls) == sum(r.num_images for r in reqs) == expected_images
    assert len(set(urls)) == expected_distinct
    for r in reqs:
        assert len(r.prompt.split()) == 7 and r.output_len == 5
    if urls:
        image = _decode_data_url(urls[0])
        assert image.size == (40, 30) and image.mode == "RGB"
    again = random_image_requests(10, 7, 5, (40, 30), fraction, unique, seed=1)
    assert [r.messages for r in again] == [r.messages for r in reqs]


def test_random_image_bad_arguments():
    from kvflow.bench.datasets import parse_image_size, random_image_requests

    assert parse_image_size("448x224") == (448, 224)
    assert parse_image_size("9459x9459") == (9459, 9459)  # 89,472,681 pixels: PIL's limit
    for spec in ("448", "axb", "0x10", "9460x9460", "100000x100000"):
        with pytest.raises(ValueError, match="image size"):
            parse_image_size(spec)
    with pytest.raises(ValueError, match="image_fraction"):
        random_image_requests(2, 3, 4, image_fraction=1.5)


def test_jsonl_messages_with_image_parts(tmp_path):
    path = tmp_path / "d.jsonl"
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
             {"type": "text", "text": "what is it"}]
    path.write_text(json.dumps({"messages": [{"role": "user", "content": parts}]}) + "\n")
    (req,) = load_jsonl(str(path), 9)
    assert req.messages[0]["content"] == parts and req.num_images == 1
    assert req.prompt == "what is it" and req.output_len == 9


def _sharegpt_file(tmp_path, conversations):
    import json

    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human" if j % 2 == 0 else "gpt", "value": v} for j, v in enumerate(turns)]}
        for i, turns in enumerate(conversations)], indent=1))
    return str(path)


def test_sharegpt_sampled_as_vllm(tmp_path, tiny_tokenizer):
    """vLLM's --dataset-name sharegpt rules: >= 2 turns, random.seed(seed) shuffle, prompt of
    4-1024 tokens, reply of >= 4 (unless a fixed output length), 2048 in all; max_tokens =
    the reply's token count. A ShareGPT file was refused ('FILE:1: Expecting value')."""
    import argparse
    import random

    from kvflow.bench.serve_workload import build_requests
    from kvflow.bench.sharegpt import load_sharegpt

    long_prompt = " ".join(str(i % 10) for i in range(1500))  # > 1024 tokens
    convs = [["only one turn here"],
             ["a", "the reply of a short prompt"],                    # prompt < 4 tokens
             [long_prompt, "a reply to a long prompt"],
             ["what is the cache block size here", "ok"],              # reply < 4 tokens
             ["tell me about the model server please", "the server has a request queue",
              "a third turn is ignored"],
             ["how does the engine decode a batch", "it runs one step for every token"],
             ["where is the prefix memory kept", "in blocks of the page table memory"]]
    path = _sharegpt_file(tmp_path, convs)

    def n_tok(text):
        return len(tiny_tokenizer(text).input_ids)

    assert n_tok("a") < 4 and n_tok(long_prompt) > 1024 and n_tok("ok") < 4
    for seed in (0, 3):
        kept = [c for c in convs if len(c) >= 2]
        random.Random(seed).shuffle(kept)
        want = [(c[0], n_tok(c[0]), n_tok(c[1])) for c in kept
                if n_tok(c[0]) >= 4 and n_tok(c[1]) >= 4 and n_tok(c[0]) <= 1024]
        got = load_sharegpt(path, 10, tiny_tokenizer, seed)
        assert [(r.prompt, r.prompt_len, r.output_len) for r in got] == want
        assert len(want) == 3
        assert [r.prompt for r in load_sharegpt(path, 2, tiny_tokenizer, seed)] == \
            [w[0] for w in want[:2]]
    # a fixed output length skips the reply-length check: the "ok" reply now qualifies
    fixed = load_sharegpt(path, 10, tiny_tokenizer, 0, output_len=5)
    assert {r.output_len for r in fixed} == {5} and len(fixed) == 4
    args = argparse.Namespace(dataset=path, num_prompts=2, seed=0, sharegpt_output_len=None,
                              output_len=64, endpoint="completions", disable_shuffle=False)
    assert build_requests(args, lambda: tiny_tokenizer) == load_sharegpt(path, 2, tiny_tokenizer, 0)
    args.disable_shuffle = True  # vLLM's --disable-shuffle: file order
    assert [r.prompt for r in build_requests(args, lambda: tiny_tokenizer)] == [
        convs[4][0], convs[5][0]]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_requests(args, lambda: None)


def test_jsonl_sampled_as_vllm_custom_dataset(tmp_path):
    """vLLM's custom JSONL dataset shuffles with random.seed(seed) and takes the first N; kvflow
    took the first N lines, so the two benchmarks sent different requests from one file."""
    import argparse
    import random

    from kvflow.bench.serve_workload import build_requests

    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "output_len": i + 1}) + "\n"
                            for i in range(10)))
    args = argparse.Namespace(dataset=str(path), num_prompts=4, seed=3, output_len=64,
                              endpoint="completions", disable_shuffle=False)
    order = list(range(10))
    random.Random(3).shuffle(order)
    assert [r.prompt for r in build_requests(args, lambda: None)] == [f"p{i}" for i in order[:4]]
    args.disable_shuffle = True
    assert [r.prompt for r in build_requests(args, lambda: None)] == ["p0", "p1", "p2", "p3"]
