"""The ``kvflow`` command line: generate, bench throughput, and one-line errors (status 2)."""

from __future__ import annotations

import json

import pytest

from kvflow.entrypoints.cli import build_parser, main


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("flag", ["--version", "-v"])
def test_version_flag_prints_the_version(capsys, flag):
    """``kvflow --version`` (vLLM's ``vllm --version``) prints the version, status 0; it was
    an error, ``the following arguments are required: command``."""
    from kvflow import __version__

    with pytest.raises(SystemExit) as e:
        main([flag])
    out = capsys.readouterr()
    assert e.value.code == 0 and out.out == f"{__version__}\n" and out.err == ""


@pytest.mark.parametrize("argv, needle", [
    (["--model", "no-such-model"], "no-such-model"),
    # the flag the user typed, not the field behind it (was SamplingParams.max_tokens=0)
    (["--max-tokens", "0"], "kvflow: error: --max-tokens=0 is invalid: it must be >= 1"),
    (["--top-p", "2"], "kvflow: error: --top-p=2.0 is invalid"),
    (["--temperature", "-1"], "kvflow: error: --temperature=-1.0 is invalid"),
    (["--min-tokens", "5", "--max-tokens", "3"], "kvflow: error: --min-tokens=5 is invalid"),
    # engine flags too (was num_kv_blocks=1 must be >= 2)
    (["--num-kv-blocks", "1"], "kvflow: error: --num-kv-blocks=1 must be >= 2"),
    (["--max-model-len", "0"], "kvflow: error: --max-model-len=0 must be >= 1"),
    # a server option: generate ran and ignored it (LLM(admission_control=True) refuses it)
    (["--admission-control"], "kvflow: error: admission_control is a server option"),
])
def test_bad_input_exits_2_with_one_line(tiny_llama, capsys, argv, needle):
    args = ["generate", "--model", tiny_llama.path, "--prompt", "hi", *argv]
    rc, _out, err = _run(args, capsys)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvflow: error:") and needle in lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--n", "2.5"], "argument --n: invalid int value: '2.5'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    # a prefix of a flag is not the flag (argparse's abbreviations are off, as in vLLM)
    # and the closest flag is named (newcomer trial: no hint was given)
    (["--max-token", "4"], "unrecognized arguments: --max-token 4 (did you mean --max-tokens?)"),
    (["--temprature=0.5", "--cpu-gemn", "auto"],
     ("unrecognized arguments: --temprature=0.5 --cpu-gemn auto (did you mean --temperature or "
      "--cpu-gemm?)")),
])
def test_argument_errors_are_one_line(tiny_llama, capsys, argv, needle):
    """argparse's own errors too: one line on stderr, status 2, not the whole usage block,
    starting ``kvflow: error:`` as kvflow's own errors do (was ``kvflow generate: error:``)."""
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--model", tiny_llama.path, *argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and needle in lines[0], err
    assert lines[0].startswith(f"kvflow: error: {needle}") and \
        lines[0].endswith(" (see kvflow generate --help)"), err


def test_argument_errors_of_nested_commands(capsys):
    """``kvflow bench serve`` and a missing command: the same ``kvflow: error:`` line."""
    for argv, help_of in ((["bench", "serve", "--no-such-flag"], "kvflow bench serve"),
                          ([], "kvflow")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert exc.value.code == 2 and len(lines) == 1, lines
        assert lines[0].startswith("kvflow: error: ") and \
            lines[0].endswith(f"(see {help_of} --help)"), lines


def test_logprobs_flag_prints_each_token(tiny_llama, capsys):
    from kvflow import LLM, SamplingParams

    (expected,) = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64).generate(
        "the lazy fox", SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)
    rc, out, _ = _run(["generate", "--model", tiny_llama.path, "--dtype", "float32",
                       "--num-kv-blocks", "64", "--prompt", "the lazy fox", "--max-tokens", "3", "--temperature", "0",
                       "--logprobs", "2"], capsys)
    sample = expected.outputs[0]
    lines = out.splitlines()[1:]
    assert rc == 0 and len(lines) == 3
    for line, token_id, top in zip(lines, sample.token_ids, sample.logprobs):
        chosen = top[token_id]
        assert line.startswith(f"  {chosen.decoded_token!r} {chosen.logprob:.3f}")
        others = [f"{lp.decoded_token!r}={lp.logprob:.3f}" for tid, lp in top.items()
                  if tid != token_id]
        assert others and all(o in line for o in others)


def test_prompt_longer_than_max_model_len_exits_2(tiny_llama, capsys):
    rc, _, err = _run(["generate", "--model", tiny_llama.path, "--max-model-len", "8",
                       "--num-kv-blocks", "16", "--prompt", "the lazy fox pages keys and values " * 4], capsys)
    assert rc == 2 and "max_model_len is 8" in err


def test_max_tokens_beyond_the_context_notes_where_it_stops(tiny_llama, capsys):
    """``--max-tokens`` above max_model_len is not refused (the offline API stops at the
    context with finish_reason length, README) but a note on stderr says so before the
    wait; the sample fills the context exactly (hand count: max_model_len minus the
    prompt's tokens)."""
    from transformers import AutoTokenizer

    prompt_len = len(AutoTokenizer.from_pretrained(tiny_llama.path).encode("the lazy fox"))
    rc, out, err = _run(["generate", "--model", tiny_llama.path, "--dtype", "float32",
                         "--num-kv-blocks", "16", "--max-model-len", "24", "--prompt",
                         "the lazy fox", "--max-tokens", "1000000000", "--temperature", "0",
                         "--ignore-eos", "--verbose"], capsys)
    assert rc == 0
    assert "kvflow: note: --max-tokens 1000000000 is more than the context leaves " \
        "(max_model_len 24" in err
    assert f"[finish_reason=length tokens={24 - prompt_len} " in out


def test_generate_prints_prompt_and_completion(tiny_llama, capsys):
    from kvflow import LLM, SamplingParams

    expected = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64).generate(
        "the lazy fox", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    rc, out, _ = _run(["generate", "--model", tiny_llama.path, "--dtype", "float32",
                       "--num-kv-blocks", "64", "--prompt", "the lazy fox", "--max-tokens", "5", "--temperature", "0",
                       "--verbose"], capsys)
    assert rc == 0
    assert out.splitlines()[0] == "the lazy fox" + expected.outputs[0].text
    assert f"tokens={len(expected.outputs[0].token_ids)}" in out


def test_generate_stop_token_ids_ends_the_sample_at_the_token(tiny_llama, capsys):
    """``--stop-token-ids`` (was an unknown flag, "did you mean --spec-tokens?") is
    SamplingParams.stop_token_ids: the sample stops at the first listed id. Oracle: the
    greedy tokens without it, cut by hand after the first occurrence of the chosen id."""
    from kvflow import LLM, SamplingParams

    free = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64).generate(
        "the lazy fox", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].token_ids
    stops = [free[2], free[5]]
    want = min(free.index(t) for t in stops) + 1
    rc, out, err = _run(["generate", "--model", tiny_llama.path, "--dtype", "float32",
                         "--num-kv-blocks", "64", "--prompt", "the lazy fox", "--max-tokens",
                         "8", "--temperature", "0", "--ignore-eos", "--stop-token-ids",
                         *map(str, stops), "--verbose"], capsys)
    assert rc == 0, err
    assert f"[finish_reason=stop tokens={want} " in out


class _Writes:
    """A stdout that records each write (and says it is not a terminal, as a pipe)."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_generate_streams_the_completion_as_it_is_generated(tiny_llama, monkeypatch):
    """``kvflow generate`` writes the completion piece by piece as the steps produce it (was:
    nothing until it finished: with a large --max-tokens it looked hung), and the bytes are
    exactly what printing the finished outputs gives (oracle: LLM.generate's outputs, printed
    as the README shows them), for two prompts of n=2 samples with --logprobs lines."""
    import sys

    from kvflow import LLM, SamplingParams

    prompts = ["the lazy fox", "keys and values"]
    expected = LLM(model=tiny_llama.path, dtype="float32", num_kv_blocks=64).generate(
        prompts, SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
        use_tqdm=False)
    stdout = _Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    argv = ["generate", "--model", tiny_llama.path, "--dtype", "float32", "--num-kv-blocks",
            "64", "--max-tokens", "12", "--temperature", "0", "--ignore-eos", "--n", "2",
            "--logprobs", "1"]
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv) == 0
    lines = "".join(stdout.writes).splitlines()
    assert len(lines) == 4 * 13  # each sample's line, then one line per token
    assert lines[::13] == [out.prompt + s.text for out in expected for s in out.outputs]
    assert all(line.startswith("  ") for i, line in enumerate(lines) if i % 13)
    first = expected[0].outputs[0].text
    pieces = stdout.writes[1:stdout.writes.index("\n")]  # after the prompt, to the newline
    assert "".join(pieces) == first and len(pieces) >= 4, pieces  # streamed, not one write


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "adaptive": False}
LOOPING = ["the quick brown fox jumps over the lazy dog the quick brown fox jumps",
           "a b a b a b a b a"]  # the tiny model loops; the n-gram proposer predicts it


def test_generate_verbose_prints_speculation_counts(tiny_llama, capsys):
    """With --speculative-config, --verbose prints each request's drafted and accepted tokens,
    acceptance rate and mean acceptance length, and their totals: the counts the Python API
    reports for the same engine and prompts (RequestMetrics), the ratios computed by hand."""
    from kvflow import LLM, SamplingParams

    llm = LLM(model=tiny_llama.path, dtype="float32", block_size=4, num_kv_blocks=96,
              speculative_config=NGRAM)
    expected = [o.metrics for o in llm.generate(
        LOOPING, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        use_tqdm=False)]
    del llm
    argv = ["generate", "--model", tiny_llama.path, "--dtype", "float32", "--block-size", "4",
            "--num-kv-blocks", "96", "--speculative-config", json.dumps(NGRAM),
            "--max-tokens", "40", "--temperature", "0", "--ignore-eos", "--verbose"]
    for p in LOOPING:
        argv += ["--prompt", p]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    lines = [line for line in out.splitlines() if line.startswith("[speculative")]
    assert len(lines) == 3, out
    totals = [sum(getattr(m, k) for m in expected)
              for k in ("num_draft_tokens", "num_accepted_tokens", "num_drafts")]
    for line, (drafted, accepted, steps) in zip(lines, [
            (m.num_draft_tokens, m.num_accepted_tokens, m.num_drafts) for m in expected]
            + [tuple(totals)]):
        assert 0 < accepted < drafted
        assert (f"drafted={drafted} accepted={accepted} "
                f"acceptance_rate={accepted / drafted:.3f} verify_steps={steps} "
                f"mean_acceptance_length={1 + accepted / steps:.2f}]") in line, (line, drafted)
    assert lines[2].startswith("[speculative, all prompts:")


def test_bench_throughput_against_hf(tiny_llama, capsys, tmp_path):
    path = tmp_path / "bench.json"
    rc, out, _ = _run(["bench", "throughput", "--model", tiny_llama.path, "--dtype", "float32",
                       "--num-kv-blocks", "64", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                       "--compare", "hf", "--output-json", str(path)], capsys)
    assert rc == 0 and "kvflow / hf-transformers output throughput" in out
    results = json.loads(path.read_text())
    assert [r["engine"] for r in results] == ["kvflow", "hf-transformers"]
    for r in results:
        assert r["num_prompts"] == 4
        assert r["output_tokens_per_s"] == pytest.approx(16 / r["elapsed_s"])


def test_help_lists_only_typeable_choices():
    """An unset option (None) is a default, not a choice: ``--help`` shows
    ``{none,int8,...}`` for --quantization, never ``None``, and the parsed default stays None."""
    import argparse

    from kvflow.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    text = parser.format_help()
    assert "{none,int8,int4,fp8,gguf,compressed-tensors,gptq,awq,gptq_marlin,awq_marlin}" \
        in text
    assert "{auto,native,onednn}" in text and "None," not in text
    assert "{auto,native,sdpa}" in text
    args = parser.parse_args([])
    assert args.quantization is None and args.cpu_gemm is None and args.cpu_attention is None
    assert parser.parse_args(["--cpu-attention", "sdpa"]).cpu_attention == "sdpa"


def test_vllm_scheduling_policy_name_is_accepted():
    """vLLM's ``--scheduling-policy`` / ``scheduling_policy=`` name ``--policy`` (they were
    'unrecognized arguments' / 'unknown engine option'); giving both names is refused."""
    from kvflow.config import EngineConfig

    args = build_parser().parse_args(["serve", "m", "--scheduling-policy", "priority"])
    assert EngineConfig.from_cli_args(args).scheduler_config.policy == "priority"
    config = EngineConfig.from_kwargs(model="m", scheduling_policy="fair")
    assert config.scheduler_config.policy == "fair"
    with pytest.raises(ValueError, match="scheduling_policy and policy name the same"):
        EngineConfig.from_kwargs(model="m", scheduling_policy="fair", policy="fcfs")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_ctrl_c_exits_130_without_a_traceback(monkeypatch, capsys, command):
    """Ctrl-C: ``kvflow serve`` shuts down, then uvicorn re-raises the SIGINT it handled as
    KeyboardInterrupt; ``kvflow`` exits 130 (128 + SIGINT) without printing a traceback (was:
    the KeyboardInterrupt traceback, found with benchmarks/worker_faults.py serve-sigint). The
    command is replaced by one that is interrupted."""
    from kvflow.entrypoints import cli, cli_generate

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_generate if command == "generate" else cli, f"_cmd_{command}",
                        interrupted)
    assert main([command, "--model", "m"]) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("argv, exits", [(None, True), (["serve", "--model", "m"], False)])
def test_serve_from_the_command_line_exits_at_once(monkeypatch, argv, exits):
    """``kvflow serve`` run as the process's command (``argv`` None) ends the process with
    os._exit once the server has stopped, skipping the interpreter's teardown (2.8 s with
    torch on 2 busy cores: Ctrl-C seemed to hang; benchmarks/server_signals.py measures it);
    called with an explicit argv (in a test, in another program) it returns the status."""
    import sys

    from kvflow.entrypoints import cli

    exited = []

    def fake_exit(status: int) -> None:
        exited.append(status)

    monkeypatch.setattr(sys, "argv", ["kvflow", "serve", "--model", "m"])
    monkeypatch.setattr(cli, "_cmd_serve", lambda args: 130)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    assert main(argv) == 130
    assert exited == ([130] if exits else [])


def test_generate_applies_the_lora_path_adapter(tiny_llama, capsys, tmp_path):
    """``kvflow generate --enable-lora --lora-path FOLDER`` decodes every prompt with the
    adapter: peft's greedy tokens (the flag did not exist, and ``--enable-lora`` alone ran the
    base model with nothing said); either flag without the other is one error line."""
    from transformers import AutoTokenizer

    from tests.lora.adapters import make_adapter, peft_greedy

    adapter = make_adapter(tiny_llama.path, str(tmp_path / "qv"), 5, r=4, lora_alpha=8,
                           target_modules=["q_proj", "v_proj", "down_proj"])
    prompt = "the lazy fox jumps"
    tok = AutoTokenizer.from_pretrained(tiny_llama.path)
    want = peft_greedy(tiny_llama.path, adapter, tok.encode(prompt))
    assert want != peft_greedy(tiny_llama.path, None, tok.encode(prompt))
    argv = ["generate", "--model", tiny_llama.path, "--dtype", "float32", "--num-kv-blocks",
            "32", "--prompt", prompt, "--max-tokens", str(len(want)), "--temperature", "0",
            "--ignore-eos"]
    rc, out, _ = _run([*argv, "--enable-lora", "--max-lora-rank", "4", "--lora-path", adapter],
                      capsys)
    assert rc == 0
    assert out.startswith(prompt + tok.decode(want))
    for extra, needle in ((["--enable-lora"], "--enable-lora without --lora-path"),
                          (["--lora-path", adapter], "needs --enable-lora")):
        rc, _, err = _run([*argv, *extra], capsys)
        assert rc == 2 and needle in err, err


def test_generate_into_a_pipe_closed_early_ends_quietly(tiny_llama, monkeypatch, capsys):
    """``kvflow generate ... | head -c 20``: the reader leaves while the completion streams;
    the command ends with status 141 (128 + SIGPIPE, as ``yes | head`` does) and nothing on
    stderr (was: two BrokenPipeError tracebacks). A stdout that breaks after its first
    write stands in for the pipe."""
    import sys

    class ClosedAfterOne(_Writes):
        def write(self, text: str) -> int:
            if self.writes:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

    stdout = ClosedAfterOne()
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", stdout)
    argv = ["generate", "--model", tiny_llama.path, "--dtype", "float32", "--num-kv-blocks",
            "64", "--max-tokens", "8", "--ignore-eos", "--prompt", "the lazy fox"]
    assert main(argv) == 141
    assert stdout.writes == ["the lazy fox"] and capsys.readouterr().err == ""


def test_every_flag_has_help_text():
    """``--help`` of each subcommand explains every flag (``kvflow generate --ignore-eos``,
    ``bench serve --endpoint`` and eight bench flags printed a bare name before)."""
    from kvflow.entrypoints.config_file import leaf_parsers

    bare = [f"{leaf.prog} {action.option_strings[0]}"
            for leaf in leaf_parsers(build_parser()) for action in leaf._actions
            if action.option_strings and not action.help]
    assert bare == []


def test_serve_and_generate_parse_without_the_other_commands_modules(monkeypatch, capsys):
    """``kvflow serve`` / ``generate`` build only their own parsers (run-batch's and bench's
    import their modules, 0.4-0.5 s of CPU at every server start); a line parses to the same
    namespace as with every command's parser, and its errors are the same."""
    from kvflow.entrypoints import cli

    calls = []
    real = cli._add_other_parsers
    monkeypatch.setattr(cli, "_add_other_parsers", lambda sub: calls.append(sub) or real(sub))
    line = ["serve", "m", "--max-model-len", "64", "--policy", "priority", "--port", "9"]
    assert vars(build_parser("serve").parse_args(line)) == vars(build_parser().parse_args(line))
    assert vars(build_parser("generate").parse_args(["generate", "--model", "m"])) == vars(
        build_parser().parse_args(["generate", "--model", "m"]))
    assert len(calls) == 2  # the two full parsers only
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--no-such-flag"])
    assert e.value.code == 2 and len(calls) == 2
    assert capsys.readouterr().err == ("kvflow: error: unrecognized arguments: --no-such-flag "
                                       "(see kvflow serve --help)\n")
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--no-such-flag"])
    assert len(calls) == 3 and "(see kvflow bench serve --help)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, refused", [
    (["serve", "a", "--model", "b"], True),
    (["serve", "a", "--model=b"], True),
    (["serve", "a", "--model", "a"], False),
    (["serve", "a"], False),
    (["serve", "--model", "b"], False),
])
def test_serve_refuses_two_different_models(monkeypatch, capsys, argv, refused):
    """``kvflow serve a --model b`` served ``a`` and dropped ``--model b`` silently (found
    by the session-43 newcomer trial); now exit 2 naming both. One of them, or both naming
    the same model, serves it."""
    from kvflow.entrypoints import cli

    served = []
    monkeypatch.setattr(cli, "_cmd_serve", lambda args: served.append(args.model) or 0)
    assert main(argv) == (2 if refused else 0)
    err = capsys.readouterr().err
    if refused:
        assert err == ("kvflow: error: the positional MODEL 'a' and --model 'b' name different "
                       "models: give one\n") and served == []
    else:
        assert err == "" and len(served) == 1  # the command ran
