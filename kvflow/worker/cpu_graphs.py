"""CPU step graphs: an all-decode step's native kernel calls, recorded once and replayed
(a speculative verification step's too, where every request has the same 1 + k tokens).

On CPU a decode step of the native kernels is a fixed sequence of C calls (a 64-row step of
SmolLM2-135M: 302 of them) with Python between them: layers, argument checks, views and
``torch.empty`` for each output. That Python cost ~8.6 ms of a 63 ms step (docs/benchmarks.md,
session 10). Like a CUDA graph, a step's calls can be recorded with their arguments and replayed
back to back, provided every address and scalar they take is the same at every step of that
shape. :class:`CpuGraphRunner` arranges that:

* the step's inputs (token ids, positions, slot mapping, sequence lengths, block table) are
  copied into static buffers first, so the kernels read them from fixed addresses;
* a recording (:mod:`kvflow.worker.cpu_step_record`) wraps every ctypes entry point of the
  kernels object and watches the forward's torch operators: an operator that computes (rather
  than allocating or viewing) makes the step unreplayable, as does a pointer argument outside
  the step's own allocations, the static buffers and the memory the model and its KV cache
  hold;
* the step's allocations are planned into one buffer shared by every batch size, reusing bytes
  between allocations whose lifetimes do not overlap (about one layer's activations).

A batch size's (with a thread count's) first step runs eagerly without a recorder: a size that
comes once, such as each step of a finishing batch's shrinking tail, never pays for a recording
(a recorded step of 17-48 rows of SmolLM2-135M took 10-16 ms more than an eager one on the Zen 4
EPYC, docs/benchmarks.md session 42). A size is trusted only after two later steps of that size
recorded the same calls with the same arguments (so nothing in them depends on the step's values) and one
replay, on a buffer filled with NaN, reproduced the eager step's hidden states bit for bit (so
no computation escaped the recording: a kernel bound elsewhere, numpy work; compared as bit
patterns, so a step whose eager result holds NaN can still be trusted). From then on its
steps replay. A size whose recordings differ :data:`MAX_MISMATCHES` times in a row (calls
that depend on the step's values) is refused, so it stops paying for recordings. A failed check turns the runner off for the engine's life (logged), and the
eager path is used, as with ``--enforce-eager``. Recording happens inside real steps: no extra
forward except the one check replay per trusted size.

A forward that also returns aux hidden states (an EAGLE-3 target's layer taps,
``LlamaModel.aux_hidden_state_layers``) has them planned like the hidden states: written by
recorded calls, kept to the end of the step, checked bit for bit, replayed from the buffer.

Used only where that holds by construction: the native CPU attention backend with its pool
closed, one KV-cache group, no multimodal, pipeline split, tensor parallel or draft model
other than an EAGLE / EAGLE-3 head, and LoRA only with its native kernel
(``kvflow/worker/step_graphs.py`` decides).

With LoRA the step's tokens -> adapter slots are staged too, into an int32 buffer that every
LoRA layer's native call reads (``kvflow.lora.layers.graph_mapping``, ``csrc/cpu_lora.c``): a
step runs those calls whether or not any of its tokens has an adapter, so one program serves
every mix of adapters, and an adapter loaded into a slot (in place) is read by the next replay.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvflow.attention.backend import AttentionMetadata
from kvflow.attention.layer import AttentionContext
from kvflow.lora.layers import LoRAContext
from kvflow.worker.cpu_step_record import (
    NotReplayable,
    Recording,
    StepProgram,
    StepRecorder,
    lasting_regions,
    normalize,
    plan_program,
)

logger = logging.getLogger(__name__)

MAX_MISMATCHES = 3  # recordings of one size that differ from the previous one before it is refused
MAX_RECORDING_BYTES = 256 << 20  # step allocations a recording may keep alive at once
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bit patterns (same shape and dtype): NaN equals
    a NaN of the same payload, unlike :func:`torch.equal`; -0.0 differs from 0.0."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    bits = _BITS[a.dtype.itemsize]
    return torch.equal(a.view(bits), b.view(bits))


class CpuGraphRunner:
    """Records all-decode steps of the native CPU kernels per batch size and replays them (see
    the module doc). Same interface as :class:`kvflow.worker.cuda_graphs.CudaGraphRunner`.

    Args:
        model: the causal LM (``forward(input_ids, positions) -> hidden``).
        attn_ctx: the engine's attention context (the native CPU backend).
        kernels: the native CPU kernels object the model's layers call.
        kv_caches: the engine's KV-cache tensors.
        max_num_seqs: largest batch (rows of the static buffers).
        max_blocks_per_seq: block-table width (max_model_len / block_size, rounded up).
        block_size: tokens per KV block.
        max_recording_bytes: step allocations one recording may keep alive (a recording keeps
            the whole step's activations, see
            :class:`~kvflow.worker.cpu_step_record.ForwardWatch`). A batch size over it is
            refused, and every larger one is then run eagerly without recording (steps of
            more rows allocate more).
        max_query_len: the query length, in tokens per request, up to which steps where
            every request has the same one (speculative decoding's verification steps: 1 +
            ``num_speculative_tokens``) are recorded too; 1: decodes only.
        lora_ctx: the model's LoRA context when LoRA is on (the caller binds the step's
            mapping around :meth:`run`); None without LoRA.

    A batch is keyed by (requests, threads), and a verification step's by (requests, threads,
    query length).
    """

    def __init__(self, model: nn.Module, attn_ctx: AttentionContext, kernels,
                 kv_caches: list[torch.Tensor], max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, max_recording_bytes: int = MAX_RECORDING_BYTES,
                 max_query_len: int = 1, lora_ctx: LoRAContext | None = None) -> None:
        self.model, self.attn_ctx, self.kernels = model, attn_ctx, kernels
        self.max_recording_bytes = max_recording_bytes
        self.max_query_len = max_query_len
        # tokens of the largest step recorded: lowered when a recording goes over budget
        self.max_recorded_rows = max_num_seqs * max_query_len
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        n, t = max_num_seqs, max_num_seqs * max_query_len
        self.input_ids = torch.zeros(t, dtype=torch.int64)
        self.positions = torch.zeros(t, dtype=torch.int64)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64)
        self.seq_lens = torch.ones(n, dtype=torch.int32)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32)
        self.lora_ctx = lora_ctx
        self.lora_slots = torch.full((t,), -1, dtype=torch.int32)  # each token's adapter slot
        self.kv_caches = kv_caches
        self.buffer = torch.empty(0, dtype=torch.uint8)  # every program's activations
        self.regions: list[tuple[int, int]] | None = None
        self.programs: dict[tuple[int, ...], StepProgram] = {}
        self.recorded: dict[tuple[int, ...], Recording] = {}
        self.refused: set[tuple[int, ...]] = set()
        self.seen: set[tuple[int, ...]] = set()  # sizes whose first (eager) step has run
        self.mismatches: dict[tuple[int, ...], int] = {}
        self.disabled: str | None = None
        self.replayed_steps = 0  # statistics (and tests)
        # EAGLE-3's taps: the forward returns (hidden, aux), both replayed from the buffer
        self.aux_layers = getattr(getattr(model, "model", None), "aux_hidden_state_layers", ())

    @staticmethod
    def _key(meta: AttentionMetadata) -> tuple[int, ...]:
        """(requests, threads), with the query length after them when it is over 1."""
        q = meta.max_query_len
        return (meta.num_reqs, torch.get_num_threads()) if q == 1 else \
            (meta.num_reqs, torch.get_num_threads(), q)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Whether ``meta``'s step is one this runner may record or replay: every request has
        the same query length, 1 (decodes) or up to ``max_query_len`` (verification steps),
        at least one of them after a context (a step of only whole prompts may take the
        prefill path, a torch operator, and would refuse the size)."""
        q = meta.max_query_len
        return self.disabled is None and 1 <= q <= self.max_query_len \
            and q < meta.max_seq_len and meta.num_reqs <= self.max_num_seqs \
            and meta.num_actual_tokens == meta.num_reqs * q \
            and (meta.num_actual_tokens <= self.max_recorded_rows
                 or self._key(meta) in self.programs) \
            and meta.block_table.shape[1] <= self.block_table.shape[1] \
            and self._key(meta) not in self.refused

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: AttentionMetadata) -> None:
        """Copy the step's inputs into the static buffers."""
        n, t, width = meta.num_reqs, meta.num_actual_tokens, meta.block_table.shape[1]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping[:t])
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        self.block_table[:n, :width].copy_(meta.block_table)
        if self.lora_ctx is not None:  # the LoRA layers' native calls read lora_slots
            self.lora_ctx.use_row_slots(self.lora_slots[:t])

    def _static_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata over the static buffers (for a recorded, eager step)."""
        n, t = meta.num_reqs, meta.num_actual_tokens
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.seq_lens[:n], block_table=self.block_table[:n],
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            num_actual_tokens=t)

    def _eager(self, static: AttentionMetadata, recorder: StepRecorder | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        t = static.num_actual_tokens
        with self.attn_ctx.forward_context.bind([static]):
            self.attn_ctx.backend.prepare(static, self.block_size)
            if recorder is None:
                return self.model(self.input_ids[:t], self.positions[:t])
            with recorder:
                return self.model(self.input_ids[:t], self.positions[:t])

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """The step's final hidden states [num_reqs, hidden] (with the model's aux hidden
        states, EAGLE-3's taps: ``(hidden, [num_reqs, hidden] each)``, as its forward returns
        them): replayed when this batch size is trusted, else computed eagerly (and
        recorded from a size's second step on). A replayed result is a view of the runner's
        buffer: read it before the next step."""
        key = self._key(meta)
        program = self.programs.get(key)
        if program is not None:
            self.kernels.check_paged_indices(meta.num_actual_tokens, self.kv_caches[0],
                                             meta.query_start_loc, meta.seq_lens,
                                             meta.block_table)
            self._stage(input_ids, positions, meta)
            try:
                hidden = program.replay()
            except RuntimeError as exc:  # the eager step raises the kernel's own error, or
                logger.warning("%s; running the step eagerly", exc)  # succeeds on a retry
                return self._eager(self._static_meta(meta))
            self.replayed_steps += 1
            return (hidden, list(program.aux_states)) if self.aux_layers else hidden
        self._stage(input_ids, positions, meta)
        if key not in self.seen:  # a size seen once may not come back: no recording yet
            self.seen.add(key)
            return self._eager(self._static_meta(meta))
        return self._record(key, self._static_meta(meta))

    def _record(self, key: tuple[int, ...], static: AttentionMetadata
                ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Run the step eagerly under a recorder; trust ``key`` when this recording names the
        same calls as the previous one and its planned program, replayed on a NaN-filled
        buffer, reproduces the step."""
        recorder = StepRecorder(self.kernels, self.max_recording_bytes)
        out = self._eager(static, recorder)
        hidden, aux = out if isinstance(out, tuple) else (out, [])
        try:
            if recorder.watch.over_budget:
                t = static.num_actual_tokens
                self.max_recorded_rows = min(self.max_recorded_rows, t - 1)
                raise NotReplayable(f"its allocations exceed {self.max_recording_bytes} bytes "
                                    f"(no step of {t} or more tokens is recorded)")
            if recorder.watch.refused is not None:
                raise NotReplayable(f"the forward computes with {recorder.watch.refused}")
            recording = normalize(recorder.calls, recorder.watch.blocks, self._regions())
            previous, self.recorded[key] = self.recorded.get(key), recording
            if previous is None:
                return out  # the next step of this size must record the same calls
            if not previous.same_as(recording):
                self.mismatches[key] = self.mismatches.get(key, 0) + 1
                if self.mismatches[key] >= MAX_MISMATCHES:
                    raise NotReplayable(f"{MAX_MISMATCHES} recordings in a row made "
                                        "different calls")
                return out
            program = plan_program(recording, hidden, aux)
        except NotReplayable as exc:
            self.refused.add(key)
            self.recorded.pop(key, None)
            logger.info("CPU step graph for batch %d, %d threads: not replayable (%s)",
                        key[0], key[1], exc)
            return out
        del self.recorded[key]
        self.mismatches.pop(key, None)
        self._bind(program)
        self.buffer.fill_(255)  # NaN in every float dtype: a write the recording missed shows
        try:
            replayed = program.replay()
        except RuntimeError as exc:  # as in run(): the step's eager result stands, the size
            logger.warning("%s; batch %d not trusted yet", exc, key[0])  # records again later
            return out
        if not same_bits(replayed, hidden) or not all(
                same_bits(a, b) for a, b in zip(program.aux_states, aux, strict=True)):
            self.disabled = "a replay did not reproduce the eager step"
            logger.warning("CPU step graphs off: %s (batch %d)", self.disabled, key[0])
            self.programs.clear()
            return self._eager(static)  # writes the step's K/V again, eagerly
        self.programs[key] = program
        return out

    def _regions(self) -> list[tuple[int, int]]:
        if self.regions is None:
            static = [self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
                      self.query_start_loc, self.block_table, self.lora_slots]
            self.regions = lasting_regions(self.model, static + list(self.kv_caches))
        return self.regions

    def _bind(self, program: StepProgram) -> None:
        """Bind ``program`` to the shared buffer, growing it (and rebinding the others)."""
        replayer = getattr(self.kernels, "replayer", None)  # calls run from C (cpu_replay.c)
        if program.size > self.buffer.numel():
            self.buffer = torch.empty(program.size, dtype=torch.uint8)
            for other in self.programs.values():
                other.bind(self.buffer, replayer)
        program.bind(self.buffer, replayer)

