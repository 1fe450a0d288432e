"""Parse a GGUF file's header: metadata key/values and the tensor table, without the data.

A small parser of the GGUF v2/v3 layout (``gguf.GGUFReader`` takes seconds on a large
vocabulary; see :func:`read_gguf_metadata`)."""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

GGUF_MAGIC = b"GGUF"

# GGUF metadata value types (gguf.GGUFValueType): struct formats of the fixed-size ones.
_SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY_TYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's header entry.

    ``shape`` is in PyTorch/numpy order (GGUF stores dimensions innermost-first, i.e.
    reversed), ``ggml_type`` a ``gguf.GGMLQuantizationType`` value, ``offset`` the absolute
    byte offset of the data in the file and ``n_bytes`` its size.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's header: ``fields`` maps metadata keys to Python values (str, int, float,
    bool, or lists of them) and ``tensors`` lists the tensor entries in file order."""

    path: str
    version: int
    fields: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


def _check_gguf_file(path: str) -> str:
    """Validate that ``path`` is an existing file starting with the GGUF magic."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path!r}")
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a valid GGUF file: it is not a regular file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path!r} is not a valid GGUF file (expected magic {GGUF_MAGIC!r}, got {magic!r})"
        )
    return path


class _HeaderParser:
    """Sequential little-endian reader over the file's bytes (an mmap)."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        """The next GGUF string (uint64 byte length, then UTF-8 bytes; bad bytes replaced).

        Raises:
            ValueError: when the string runs past the end of the file.
            struct.error: when its length field does.
        """
        n = self.unpack("Q")
        if self.pos + n > self.size:
            raise ValueError("string runs past the end of the file")
        value = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return value

    def value(self, vtype: int) -> Any:
        """The next metadata value of GGUF type ``vtype``: a scalar, a string, or a list for an
        array (nested arrays as nested lists).

        Raises:
            ValueError: for an unknown value or array item type, or a string or array past
                the end of the file.
            struct.error: when a scalar or length field runs past the end of the file.
        """
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("I"), self.unpack("Q")
            if item_type == _STRING:
                return [self.string() for _ in range(count)]
            if item_type in _NUMPY_TYPES:
                import numpy as np

                dtype = np.dtype(_NUMPY_TYPES[item_type])
                if self.pos + count * dtype.itemsize > self.size:
                    raise ValueError("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                values = arr.tolist()
                del arr  # release the buffer export so the mmap can close
                self.pos += count * dtype.itemsize
                return values
            if item_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            raise ValueError(f"unknown array item type {item_type}")
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        raise ValueError(f"unknown metadata value type {vtype}")


def read_gguf_metadata(path: str) -> GGUFMetadata:
    """Parse a GGUF file's header (metadata key/values and tensor infos) without its data.

    This is a small pure-Python parser of the GGUF v2/v3 little-endian layout (as documented
    in ggml's ``docs/gguf.md`` and implemented by ``gguf.GGUFReader``). It exists because
    ``gguf.GGUFReader`` builds a numpy memmap slice per metadata array element, which takes
    ~5-8 s for a 49k-token vocabulary on a small CPU (more for 150k-token Qwen vocabularies);
    this parser reads the same header in well under a second. Tests check it against
    ``GGUFReader``.

    A process parses each file once: the header is kept (the 4 files last read) and handed
    out again while the file's device, inode, size and modification time are unchanged
    (``kvflow serve`` of a GGUF file read it 3 times in the API process, for the config, the
    tokenizer and the EOS ids, and twice in the engine core, for the config and the
    weights; 1.4 s a parse of SmolLM2-135M's on 2 busy cores). Callers must not change the
    returned metadata (nothing in kvflow does).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a valid (v2/v3, little-endian) GGUF file.
    """
    path = _check_gguf_file(path)
    st = os.stat(path)
    return _read_header(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_header(path: str, dev: int, ino: int, size: int, mtime_ns: int) -> GGUFMetadata:
    """:func:`read_gguf_metadata`'s parse of ``path``, cached under the file's identity
    (``dev``, ``ino``, ``size``, ``mtime_ns``: a rewritten file is parsed again)."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                return _parse_header(path, mm, size)
            except struct.error:  # a number runs past the end of the file
                raise ValueError(f"{path!r} is not a valid GGUF file: its header runs past the "
                                 "end of the file (truncated?)") from None
            except (ValueError, IndexError, OverflowError, MemoryError) as e:
                raise ValueError(f"{path!r} is not a valid GGUF file: {e}") from e


def _parse_header(path: str, buf, size: int) -> GGUFMetadata:
    """The metadata of the GGUF file ``path`` (its bytes ``buf``, ``size`` bytes long):
    version, key-value fields and each tensor's type, shape and byte range.

    Raises:
        ValueError: for a big-endian or unsupported version, implausible counts, a tensor
            of more than 8 dimensions, a bad ``general.alignment``, or a tensor whose type
            is unknown, whose rows do not fill whole blocks or whose data runs past the end.
    """
    p = _HeaderParser(buf, size)
    p.pos = 4  # magic, checked by _check_gguf_file
    version = p.unpack("I")
    if version & 0xFFFF == 0:
        raise ValueError("big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = p.unpack("Q"), p.unpack("Q")
    if n_tensors > size or n_kv > size:
        raise ValueError(f"implausible header counts ({n_tensors} tensors, {n_kv} keys)")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.string()
        fields[key] = p.value(p.unpack("I"))
    infos = [_tensor_entry(p) for _ in range(n_tensors)]
    data_start = _data_start(fields, p.pos)
    tensors = _tensor_table(infos, data_start, size)
    return GGUFMetadata(path, version, fields, tuple(tensors))


def _tensor_entry(p: _HeaderParser) -> tuple[str, list[int], int, int]:
    """The next tensor entry of the header: (name, dims (GGUF order, innermost first), ggml
    type, its data's offset in bytes from the data section's start).

    Raises:
        ValueError: for more than 8 dimensions.
    """
    name = p.string()
    n_dims = p.unpack("I")
    if n_dims > 8:
        raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
    dims = [p.unpack("Q") for _ in range(n_dims)]
    return name, dims, p.unpack("I"), p.unpack("Q")


def _data_start(fields: dict[str, Any], header_end: int) -> int:
    """The data section's first byte: the header's end rounded up to ``general.alignment``
    (32 when unset).

    Raises:
        ValueError: for an alignment that is not a positive power of two.
    """
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r:.80}")
    return -(-header_end // alignment) * alignment


def _tensor_table(infos: list[tuple[str, list[int], int, int]], data_start: int,
                  size: int) -> list[GGUFTensorInfo]:
    """Each tensor entry (:func:`_tensor_entry`) with its shape (outermost first) and its
    data's byte range in the file (``size`` bytes long).

    Raises:
        ValueError: for an unknown ggml type, a row that is not a whole number of blocks,
            or data past the end of the file.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensors = []
    for name, dims, ggml_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block_size, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name!r} has unknown ggml type {ggml_type}") from None
        n_elems = math.prod(dims)
        if dims and dims[0] % block_size:
            raise ValueError(f"tensor {name!r}: row of {dims[0]} not a multiple of {block_size}")
        n_bytes = n_elems // block_size * type_size
        start = data_start + offset
        if start + n_bytes > size:
            raise ValueError(f"tensor {name!r} data runs past the end of the file (truncated?)")
        shape = tuple(int(d) for d in reversed(dims))
        tensors.append(GGUFTensorInfo(name, shape, int(ggml_type), start, n_bytes))
    return tensors
