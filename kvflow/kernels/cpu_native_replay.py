"""Running a recorded step's native calls from C (``csrc/cpu_replay.c``), for the CPU step
graphs (:mod:`kvflow.worker.cpu_graphs`).

From Python each replayed call costs ctypes' argument conversion plus the interpreter's loop
(~1.3 us for ``kvflow_gemm``'s 13 arguments on a Zen 4 EPYC; a SmolLM2-135M decode step makes
~300 calls), while the other OpenMP thread waits. :class:`CallReplayer` encodes a run of calls
once, when a program is bound, into 64-bit words (the entry point's index in the C table, then
its arguments) and replays the run with one ctypes call. A call whose entry point is not in
the C table (another library's, or one the table lacks) stays a Python call between runs.
Every call is the same C function with the same arguments either way, so results are the
same bit for bit.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

import torch

from kvflow.kernels.cpu_native_common import bind, c_int, f32, i64, ptr

# a run: (encoded calls, entry point names) or a lone Python call: (entry point, args)
Segment = tuple[torch.Tensor, list[str]] | tuple[ctypes._CFuncPtr, tuple]


def _address(fn) -> int:
    """The C address of a ctypes entry point (0 for anything else)."""
    if not isinstance(fn, ctypes._CFuncPtr):
        return 0
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


class CallReplayer:
    """``csrc/cpu_replay.c``'s table of entry points and its replay loop, bound on ``lib``.

    Raises:
        AttributeError: (construction) when the library lacks the replay entry points.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._replay = bind(lib, "kvflow_replay", i64, [ptr, i64])
        count = bind(lib, "kvflow_replay_entries", i64, [])()
        entry = bind(lib, "kvflow_replay_entry", ctypes.c_char_p,
                     [i64, ctypes.POINTER(i64), ctypes.POINTER(i64)])
        # entry point address -> (index in the C table, argument count)
        self.entries: dict[int, tuple[int, int]] = {}
        for i in range(count):
            argc, fn = i64(), i64()
            entry(i, ctypes.byref(argc), ctypes.byref(fn))
            self.entries[fn.value] = (i, argc.value)

    def encodes(self, fn: ctypes._CFuncPtr) -> bool:
        """Whether calls of ``fn`` can run from C: its address is in the table, with as many
        arguments as its ctypes signature, each a pointer, integer or float."""
        entry = self.entries.get(_address(fn))
        types = getattr(fn, "argtypes", None)
        return entry is not None and types is not None and entry[1] == len(types) and \
            all(t in (ptr, i64, c_int, f32) for t in types)

    def encode(self, calls: Sequence[tuple[ctypes._CFuncPtr, tuple]]) -> list[Segment]:
        """``calls`` ((entry point, args), in order) as segments for :meth:`run`: each run of
        consecutive calls that :meth:`encodes` as one int64 tensor of words, the others as
        they are. Pointer arguments are addresses (ints) or None (NULL)."""
        segments: list[Segment] = []
        words: list[int] = []
        names: list[str] = []
        for fn, args in calls:
            if not self.encodes(fn):
                if names:
                    segments.append((torch.tensor(words, dtype=torch.int64), names))
                    words, names = [], []
                segments.append((fn, tuple(args)))
                continue
            words.append(self.entries[_address(fn)][0])
            words.extend(_word(t, v) for t, v in zip(fn.argtypes, args, strict=True))
            names.append(fn.__name__)
        if names:
            segments.append((torch.tensor(words, dtype=torch.int64), names))
        return segments

    def run(self, segments: list[Segment]) -> None:
        """Run the segments' calls in order.

        Raises:
            RuntimeError: when a call returns a nonzero status (named; the calls after it do
                not run).
        """
        for first, second in segments:
            if isinstance(first, torch.Tensor):
                status = self._replay(first.data_ptr(), len(second))
                if status:
                    raise RuntimeError(f"replayed native call {second[abs(status) - 1]} failed")
            elif first(*second):
                raise RuntimeError(f"replayed native call {first.__name__} failed")


def _word(kind, value) -> int:
    """One argument as its 64-bit word: a float as its IEEE-754 single bits, None as 0."""
    value = getattr(value, "value", value)  # a ctypes instance: its Python value
    if kind is f32:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    return 0 if value is None else int(value)
