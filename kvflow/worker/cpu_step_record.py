"""Recording one CPU forward's native calls and turning them into a replayable program
(the mechanism under :mod:`kvflow.worker.cpu_graphs`).

* :class:`StepRecorder`: while a forward runs under it, every ctypes entry point of the kernels
  object appends ``(entry point, args)`` to a list, and a ``TorchDispatchMode`` keeps every
  tensor the forward allocates (``aten.empty``: the kernels' outputs) and notes the first torch
  operator that computes rather than allocates or views (such a forward is not replayable).
* :func:`normalize`: each pointer argument is named by what it points into: an allocation of
  the step (its index and an offset) or memory that outlives steps (the model's weights, the KV
  cache, the runner's static inputs: its address). Two steps whose normalized calls are equal
  made the same calls on the same data; any other pointer makes the step unreplayable.
* :func:`plan_program`: the step's allocations get offsets in one buffer, two of them sharing
  bytes when no call uses both while both are live (the lifetime of an allocation runs from
  the first call that takes a pointer into it to the last; the hidden states to the end), so a
  program needs about one layer's activations, not the step's sum.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ALIGN = 64  # bytes: planned allocations start on a cache line


class NotReplayable(Exception):
    """A recorded step cannot be replayed (the message says why)."""


def _is_view_like(func, args, out) -> bool:
    """Whether ``func`` (an aten overload) only made views or returned an input as it is: a
    view op by its schema, or a non-mutating op (``to``, ``reshape``, ``contiguous``, numpy
    conversion) whose tensor results share the first tensor argument's storage."""
    if func._schema.is_mutable:
        return False
    if func.is_view:
        return True
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return False
    base = first.untyped_storage().data_ptr()
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return all(not isinstance(o, torch.Tensor) or o.untyped_storage().data_ptr() == base
               for o in outs)


class ForwardWatch(TorchDispatchMode):
    """Keeps the tensors ``aten.empty`` allocates (``blocks``, in order) and notes the first
    operator that computes (``refused``, its name; None while there is none).

    Keeping every allocation alive holds the whole step's activations at once (a plain forward
    frees each layer's). Past ``max_bytes`` of them the watch lets them all go, keeps no more
    and sets ``over_budget`` (the recording is then refused), so the peak stays near
    ``max_bytes`` plus what the forward holds itself.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: no step runs under ``torch.compile``, so ``__torch_dispatch__`` needs no
        ``torch._disable_dynamo`` wrapper (``TorchDispatchMode``'s default), whose first call
        imports ``torch._dynamo``: ~0.5 s inside the engine's first recorded step, a late
        token of its first request (docs/benchmarks.md, session 42)."""
        return False

    def __init__(self, max_bytes: int | None = None) -> None:
        super().__init__()
        self.blocks: list[torch.Tensor] = []
        self.refused: str | None = None
        self.max_bytes, self.kept_bytes, self.over_budget = max_bytes, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.empty.memory_format:
            self._keep(out)
        elif self.refused is None and not _is_view_like(func, args, out):
            self.refused = str(func)
        return out

    def _keep(self, block: torch.Tensor) -> None:
        if self.over_budget:
            return
        self.kept_bytes += block.untyped_storage().nbytes()
        if self.max_bytes is not None and self.kept_bytes > self.max_bytes:
            self.over_budget = True
            self.blocks.clear()
            return
        self.blocks.append(block)


class StepRecorder:
    """Records the native calls of one forward (``with recorder: model(...)``): every ctypes
    entry point bound on ``kernels`` is replaced, for the duration, by one that appends
    ``(entry point, args)`` to ``calls`` and calls through; ``watch`` sees the torch operators
    and keeps up to ``max_bytes`` of the forward's allocations (:class:`ForwardWatch`).

    The kernels object is shared by every engine of the process: only calls made on the
    recording thread are recorded (another engine's model thread calls straight through, and
    ``watch``, a dispatch mode, is thread-local too), and one recorder at a time swaps the
    entry points (a lock kept on the kernels object), so two recorders never restore each
    other's wrappers.
    """

    def __init__(self, kernels, max_bytes: int | None = None) -> None:
        self.kernels, self.calls = kernels, []
        self.watch = ForwardWatch(max_bytes)
        self._lock = vars(kernels).setdefault("_step_record_lock", threading.Lock())
        self._saved: dict[str, ctypes._CFuncPtr] = {}

    def _recording(self, fn):
        calls, thread = self.calls, threading.get_ident()

        def record(*args):
            if threading.get_ident() == thread:
                calls.append((fn, args))
            return fn(*args)
        return record

    def __enter__(self) -> StepRecorder:  # noqa: PYI034
        self._lock.acquire()
        self._saved = {name: fn for name, fn in vars(self.kernels).items()
                       if isinstance(fn, ctypes._CFuncPtr)}
        for name, fn in self._saved.items():
            setattr(self.kernels, name, self._recording(fn))
        self.watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.watch.__exit__(*exc)
            for name, fn in self._saved.items():
                setattr(self.kernels, name, fn)
        finally:
            self._lock.release()


def held_tensors(value, depth: int, seen: set[int]) -> list[torch.Tensor]:
    """Tensors held by ``value`` (a tensor, or an object's attributes ``depth`` levels down:
    a packed weight, a split of two)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0 or id(value) in seen or isinstance(value, nn.Module) \
            or not hasattr(value, "__dict__"):
        return []
    seen.add(id(value))
    return [t for v in vars(value).values() for t in held_tensors(v, depth - 1, seen)]


def _spans(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) byte ranges of the CPU storages of ``tensors``."""
    spans = sorted((t.untyped_storage().data_ptr(),
                    t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                   for t in tensors if t.device.type == "cpu" and t.layout == torch.strided
                   and t.numel())
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def lasting_regions(model: nn.Module, extra: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[start, end) byte ranges of memory that outlives steps: ``model``'s parameters and
    buffers, tensors its modules hold as attributes or up to two objects further (packed
    weights, rotary caches), and ``extra`` (KV caches, static inputs)."""
    tensors = list(model.parameters()) + list(model.buffers()) + list(extra)
    seen: set[int] = set()
    for module in model.modules():
        for value in vars(module).values():
            tensors += held_tensors(value, 3, seen)
    return _spans(tensors)


def _find(starts: list[int], ends: list[int], address: int) -> int:
    """Index of the [start, end) range holding ``address``, or -1."""
    i = bisect.bisect_right(starts, address) - 1
    return i if i >= 0 and address < ends[i] else -1


@dataclass
class Recording:
    """One recorded step, pointers named (see the module doc).

    Attributes:
        calls: [(entry point, args)] with each allocation pointer as ``("block", i, offset)``.
        sizes, addresses: bytes and address of each of the step's allocations, in allocation
            order (numbers only: a kept recording holds no memory).
        uses: per allocation, (first, last) index of the calls that point into it, or None.
    """

    calls: list
    sizes: list[int]
    addresses: list[int]
    uses: list[tuple[int, int] | None] = field(default_factory=list)

    def same_as(self, other: Recording) -> bool:
        """Whether both made the same calls on allocations of the same sizes."""
        return self.calls == other.calls and self.sizes == other.sizes


def normalize(calls: list, blocks: list[torch.Tensor],
              regions: list[tuple[int, int]]) -> Recording:
    """Name every pointer argument of ``calls`` by the allocation (of ``blocks``) or lasting
    region it points into.

    Raises:
        NotReplayable: on a pointer into neither (memory a replay cannot count on), or an
            allocation that is not a contiguous CPU tensor.
    """
    if any(b.device.type != "cpu" or not b.is_contiguous() for b in blocks):
        raise NotReplayable("the forward allocates a tensor that is not contiguous on the CPU")
    sizes = [b.untyped_storage().nbytes() for b in blocks]
    addresses = [b.data_ptr() for b in blocks]
    order = sorted(range(len(blocks)), key=lambda i: addresses[i])
    b_starts = [addresses[i] for i in order]
    b_ends = [addresses[i] + sizes[i] for i in order]
    r_starts, r_ends = [s for s, _ in regions], [e for _, e in regions]
    uses: list[tuple[int, int] | None] = [None] * len(blocks)
    named = []
    for c, (fn, args) in enumerate(calls):
        out = list(args)
        for a, (argtype, value) in enumerate(zip(fn.argtypes, args, strict=False)):
            if argtype is not ctypes.c_void_p or not value:
                continue
            j = _find(b_starts, b_ends, value)
            if j >= 0:
                i = order[j]
                out[a] = ("block", i, value - b_starts[j])
                uses[i] = (c, c) if uses[i] is None else (uses[i][0], c)
            elif _find(r_starts, r_ends, value) < 0:
                raise NotReplayable(f"{fn.__name__} takes an address outside the step's "
                                    "allocations, the model, its KV cache and the static inputs")
        named.append((fn, tuple(out)))
    return Recording(named, sizes, addresses, uses)


@dataclass
class StepProgram:
    """A planned step: the calls with their allocations' pointers as offsets into one buffer,
    :meth:`bind` to a buffer of at least ``size`` bytes before :meth:`replay`.

    Attributes:
        template: [(entry point, args, [(arg index, buffer offset)])].
        size: bytes of buffer the program needs.
        hidden: (buffer offset, shape, stride, dtype) of the final hidden states.
        aux: the same of each aux hidden state the forward also returned (EAGLE-3's taps,
            ``LlamaModel.aux_hidden_state_layers``), in order; bound as ``aux_states``.
    """

    template: list
    size: int
    hidden: tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]
    calls: list = field(default_factory=list)
    hidden_states: torch.Tensor | None = None
    aux: list = field(default_factory=list)
    aux_states: list = field(default_factory=list)
    replayer: object | None = None  # a kernels.cpu_native_replay.CallReplayer, when bound so
    segments: list = field(default_factory=list)  # the calls encoded for the replayer

    def bind(self, buffer: torch.Tensor, replayer=None) -> None:
        """Point the calls (and ``hidden_states``) into ``buffer`` (uint8, >= ``size``).
        With a ``replayer`` (:class:`kvflow.kernels.cpu_native_replay.CallReplayer` of the
        calls' library) :meth:`replay` runs the calls it can encode from C, in runs."""
        base = buffer.data_ptr()
        self.calls = []
        for fn, args, relocs in self.template:
            bound = list(args)
            for a, offset in relocs:
                bound[a] = base + offset
            self.calls.append((fn, tuple(bound)))
        self.replayer = replayer
        self.segments = replayer.encode(self.calls) if replayer is not None else []
        self.hidden_states = _view(buffer, self.hidden)
        self.aux_states = [_view(buffer, spec) for spec in self.aux]

    def replay(self) -> torch.Tensor:
        """Run the calls in order; returns ``hidden_states``.

        Raises:
            RuntimeError: when a call returns a nonzero status (its scratch could not be
                allocated, or a slot was out of range).
        """
        if self.replayer is not None:
            self.replayer.run(self.segments)
            return self.hidden_states
        for fn, args in self.calls:
            if fn(*args):
                raise RuntimeError(f"replayed native call {fn.__name__} failed")
        return self.hidden_states


def _view(buffer: torch.Tensor, spec: tuple) -> torch.Tensor:
    """The tensor ``spec`` ((offset, shape, stride, dtype)) places in ``buffer`` (uint8)."""
    offset, shape, stride, dtype = spec
    extent = (1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))) * dtype.itemsize
    return buffer[offset:offset + extent].view(dtype).as_strided(shape, stride)


def _place(size: int, first: int, placed: list[tuple[int, int, int]]) -> int:
    """Lowest ALIGN-aligned offset for ``size`` bytes that overlaps no block of ``placed``
    ((offset, end, last use)) still live at call ``first``."""
    offset = 0
    for start, end, last in sorted(p for p in placed if p[2] >= first):
        if offset + size <= start:
            break
        offset = max(offset, -(-end // ALIGN) * ALIGN)
    return offset


def plan_program(recording: Recording, hidden: torch.Tensor,
                 aux: list[torch.Tensor] = ()) -> StepProgram:
    """Offsets for the step's allocations in one buffer (greedy, in order of first use; see the
    module doc) and the program over them. ``hidden`` is the forward's result (a view of one
    of the allocations), ``aux`` the aux hidden states it also returned (EAGLE-3's taps):
    their allocations live to the end of the step too.

    Raises:
        NotReplayable: when ``hidden`` or an ``aux`` tensor is not in one of the step's
            allocations written by a recorded call.
    """
    sizes, addresses, uses = recording.sizes, recording.addresses, list(recording.uses)
    owners = []
    for result in (hidden, *aux):
        owner = next((i for i, (a, n) in enumerate(zip(addresses, sizes, strict=True))
                      if a <= result.data_ptr() < a + n), None)
        if owner is None or uses[owner] is None:
            raise NotReplayable("the forward's result is not written by a recorded call")
        uses[owner] = (uses[owner][0], len(recording.calls))  # read after the step
        owners.append(owner)
    offsets: dict[int, int] = {}
    placed: list[tuple[int, int, int]] = []
    for i in sorted((i for i, u in enumerate(uses) if u is not None), key=lambda i: uses[i]):
        size = sizes[i]
        offsets[i] = _place(size, uses[i][0], placed)
        placed.append((offsets[i], offsets[i] + size, uses[i][1]))
    template = []
    for fn, args in recording.calls:
        relocs = [(a, offsets[v[1]] + v[2]) for a, v in enumerate(args)
                  if isinstance(v, tuple)]
        template.append((fn, args, relocs))
    specs = [(offsets[i] + t.data_ptr() - addresses[i], tuple(t.shape), tuple(t.stride()),
              t.dtype) for i, t in zip(owners, (hidden, *aux), strict=True)]
    size = max((end for _, end, _ in placed), default=0)
    return StepProgram(template, size, specs[0], aux=specs[1:])
