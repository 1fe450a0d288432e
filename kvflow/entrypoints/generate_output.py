"""What ``kvflow generate`` prints, written as the tokens are generated.

For each prompt in order, each sample: its line (the prompt then the completion; the
completion alone with ``--chat``), with ``--verbose`` a ``[finish_reason=... tokens=...
ttft=... e2e=...]`` line, with ``--logprobs`` one line per token; with ``--verbose`` and
``--speculative-config`` a ``[speculative: ...]`` line per prompt, and one for all prompts.

The first sample of the earliest prompt not yet printed streams (its text appears token by
token, as ``llama.cpp`` and ``ollama run`` show it); the rest of that prompt is printed when it
finishes, then the next prompt's first sample streams, from what it already has. The bytes
written are the same as printing each finished output whole, whatever the terminal (a pipe or
a file gets them too, flushed as they come).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from kvflow.outputs import CompletionOutput, RequestMetrics, RequestOutput


class GeneratePrinter:
    """Prints the outputs of one ``kvflow generate`` run as they arrive (``update``).

    Args:
        num_prompts: how many prompts the run has (``update`` takes indices below it).
        out: where to write (``sys.stdout``).
        chat: print the completion alone (the prompt is a rendered conversation).
        verbose: print each sample's finish reason, token count and timings.
        logprobs: print each token's logprob and alternatives.
        speculative: with ``verbose``, print each prompt's drafted / accepted counts.
    """

    def __init__(self, num_prompts: int, out: TextIO, chat: bool = False,
                 verbose: bool = False, logprobs: bool = False,
                 speculative: bool = False) -> None:
        self.num_prompts, self.out = num_prompts, out
        self.chat, self.verbose, self.logprobs = chat, verbose, logprobs
        self.speculative = speculative and verbose
        self._latest: dict[int, RequestOutput] = {}  # prompt index -> newest (cumulative)
        self._head = 0  # the prompt being printed
        self._written: int | None = None  # characters of its first sample written so far

    def update(self, index: int, output: RequestOutput) -> None:
        """Take prompt ``index``'s newest output (cumulative: every sample's text so far)
        and print what can be printed in order."""
        self._latest[index] = output
        while self._head in self._latest:
            current = self._latest[self._head]
            self._stream(current.prompt, current.outputs[0])
            if not current.finished:
                return
            self._finish(current)
            del self._latest[self._head]
            self._head += 1
            self._written = None

    def close(self) -> None:
        """End a line left open (the run was interrupted mid-sample)."""
        if self._written is not None:
            self._write("\n")
            self._written = None

    def print_totals(self, metrics: Sequence[RequestMetrics]) -> None:
        """With ``--verbose --speculative-config`` and several prompts, the counts of all."""
        if self.speculative and len(metrics) > 1:
            self._write(speculation_line("speculative, all prompts", metrics) + "\n")

    def _stream(self, prompt: str | None, sample: CompletionOutput) -> None:
        if self._written is None:
            self._write("" if self.chat else prompt or "")
            self._written = 0
        self._write(sample.text[self._written:])
        self._written = len(sample.text)

    def _finish(self, output: RequestOutput) -> None:
        prefix = "" if self.chat else output.prompt or ""
        for k, sample in enumerate(output.outputs):
            self._write("\n" if k == 0 else prefix + sample.text + "\n")
            if self.verbose:
                self._write(f"[finish_reason={sample.finish_reason} "
                            f"tokens={len(sample.token_ids)} ttft={output.metrics.ttft:.3f}s "
                            f"e2e={output.metrics.e2e_latency:.3f}s]\n")
            if self.logprobs:
                self._write("".join(line + "\n" for line in logprob_lines(sample)))
        if self.speculative:
            self._write(speculation_line("speculative", [output.metrics]) + "\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.out.flush()


def speculation_line(label: str, metrics: Sequence[RequestMetrics]) -> str:
    """``[label: drafted=D accepted=A acceptance_rate=A/D verify_steps=S
    mean_acceptance_length=1+A/S]`` summed over ``metrics`` (a request's counts, over its
    ``n`` samples); ``n/a`` for a rate without drafts."""
    steps = sum(m.num_drafts for m in metrics)
    drafted = sum(m.num_draft_tokens for m in metrics)
    accepted = sum(m.num_accepted_tokens for m in metrics)
    rate = f"{accepted / drafted:.3f}" if drafted else "n/a"
    length = f"{1 + accepted / steps:.2f}" if steps else "n/a"
    return (f"[{label}: drafted={drafted} accepted={accepted} acceptance_rate={rate} "
            f"verify_steps={steps} mean_acceptance_length={length}]")


def logprob_lines(sample: CompletionOutput) -> list[str]:
    """One line per generated token: the token, its logprob, then the top alternatives."""
    lines = []
    for token_id, top in zip(sample.token_ids, sample.logprobs or []):
        chosen = top[token_id]
        others = " ".join(f"{lp.decoded_token!r}={lp.logprob:.3f}"
                          for tid, lp in sorted(top.items(), key=lambda kv: kv[1].rank)
                          if tid != token_id)
        lines.append(f"  {chosen.decoded_token!r} {chosen.logprob:.3f}"
                     + (f"  | {others}" if others else ""))
    return lines
