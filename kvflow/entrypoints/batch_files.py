"""The files of ``kvflow run-batch``: the input read lazily, line by line (``BatchInput``),
and the output written so that a crash never leaves a half line (``BatchOutput``). Both are
opened before the model loads, so a path that cannot be read or written is one error line,
at once."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import IO, Any

_URL_PREFIXES = ("http://", "https://")


class BatchFileError(RuntimeError):
    """Reading the input or writing the output failed mid-batch (an I/O error, a full disk):
    the message names the flag, the path and the system's reason."""


@contextlib.contextmanager
def _io_errors(flag: str, path: str, doing: str) -> Iterator[None]:
    """An OSError inside (but a closed pipe's, which ``kvflow`` ends quietly) re-raised as
    ``BatchFileError``."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        raise BatchFileError(f"{flag} {path}: {doing} failed ({e.strerror or e})") from None


def _refuse_url(flag: str, path: str) -> None:
    if path.lower().startswith(_URL_PREFIXES):
        raise ValueError(f"{flag} {path}: URLs are not supported; download the file first "
                         "(curl -o FILE URL) and pass its path, or '-'")


class BatchInput:
    """The input JSONL file (``-``: stdin), read one line (bytes) at a time.

    Raises:
        ValueError: from the constructor for a URL or a path that cannot be opened for
            reading (missing, a folder, no permission).
    """

    def __init__(self, path: str) -> None:
        _refuse_url("-i", path)
        self.path = path
        if path == "-":  # a reader of its own: the interpreter's exit never waits for its
            # lock, which LineReader's thread may hold, blocked in a read (sys.stdin.buffer's
            # would abort the process: "could not acquire lock ... at interpreter shutdown")
            self._file: IO[bytes] = io.BufferedReader(io.FileIO(sys.stdin.fileno(),
                                                                closefd=False))
            return
        try:
            self._file = open(path, "rb")  # noqa: SIM115 - closed by close()
        except OSError as e:
            raise ValueError(f"-i {path}: cannot read it ({e.strerror})") from None

    def count_lines(self) -> int | None:
        """Lines in a regular file up to its last non-blank one (the lines :meth:`lines`
        yields), the file rewound; None for stdin or a pipe (the progress bar then shows no
        total)."""
        if self.path == "-" or not os.path.isfile(self.path):
            return None
        last_text = 0
        for number, line in enumerate(self._file, start=1):
            if line.strip():
                last_text = number
        self._file.seek(0)
        return last_text

    def lines(self) -> Iterator[bytes]:
        """The lines, newline included, one at a time (never the whole file in memory),
        but for the blank (whitespace-only) lines that end the file, which are dropped as
        vLLM's run-batch drops them (it strips the file); a blank line before a request is
        yielded (and answered as an empty line).

        Raises:
            BatchFileError: when a read fails.
        """
        blank: list[bytes] = []  # blank lines held until a line with text follows them
        with _io_errors("-i", self.path, "reading"):
            for line in self._file:
                if not line.strip():
                    blank.append(line)
                    continue
                yield from blank
                blank.clear()
                yield line

    def close(self) -> None:
        if self.path != "-":  # stdin's reader is left to the thread that may be reading it
            self._file.close()


class BatchOutput:
    """The output JSONL file (``-``: stdout). A regular file (or a new path) is written to a
    hidden temporary file in its folder (``.NAME.<hex>.tmp``, the umask's permissions) and
    renamed over it by :meth:`commit`, so the path holds either its old content or the whole
    output, never a half line; :meth:`discard` removes the temporary file. A symbolic link is
    followed: its target is the file replaced, the link stays. Anything else that exists
    (a device such as ``/dev/null``, a FIFO, ``/dev/stdout``) is opened and written
    through, as stdout is: each line written and flushed whole, nothing to undo (renaming
    over it would replace the device with a regular file).

    Raises:
        ValueError: from the constructor for a URL, a folder, or a path that cannot be
            written to.
    """

    def __init__(self, path: str) -> None:
        _refuse_url("-o", path)
        self.path = path
        self._temp: str | None = None
        self._target = ""  # the regular file the temporary one replaces
        if path == "-":
            self._file: IO[str] = sys.stdout
            return
        if os.path.isdir(path):
            raise ValueError(f"-o {path}: is a folder; give a file path")
        if os.path.exists(path) and not os.path.isfile(path):
            self._file = self._open_through(path)
            return
        self._target = os.path.realpath(path)
        folder, name = os.path.split(self._target)
        self._temp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            fd = os.open(self._temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as e:
            raise ValueError(f"-o {path}: cannot write there ({e.strerror})") from None
        self._file = os.fdopen(fd, "w", encoding="utf-8")

    @staticmethod
    def _open_through(path: str) -> IO[str]:
        """A device, FIFO or other non-regular path, opened for writing in place."""
        try:
            return open(path, "w", encoding="utf-8")  # closed by commit
        except OSError as e:
            raise ValueError(f"-o {path}: cannot write there ({e.strerror})") from None

    def write(self, line: dict[str, Any]) -> None:
        """Append one output line (``json.dumps`` with its default separators, non-ASCII
        kept) and its newline.

        Raises:
            BatchFileError: when the write fails (a full disk).
        """
        with _io_errors("-o", self.path, "writing"):
            self._file.write(json.dumps(line, ensure_ascii=False) + "\n")
            if self._temp is None:
                self._file.flush()

    def commit(self) -> None:
        """Flush the output to disk and put it at its path (stdout: flush).

        Raises:
            BatchFileError: when the flush or the rename fails.
        """
        with _io_errors("-o", self.path, "writing"):
            self._file.flush()
            if self._temp is None:
                if self._file is not sys.stdout:
                    self._file.close()
                return
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._temp, self._target)
        self._temp = None

    def discard(self) -> None:
        """Drop a file output not committed (its temporary file removed; the path keeps what
        it held). Safe to call after :meth:`commit` (then a no-op)."""
        if self._temp is None:
            return
        with contextlib.suppress(OSError):  # closing flushes: a full disk fails again
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temp)
        self._temp = None


class LineReader:
    """The lines of an iterator read, one at a time when asked, by a daemon thread of its
    own, so the event loop never blocks on a slow stdin and a reader still blocked there
    never holds up the process's exit (a thread of asyncio's default executor would: its
    shutdown waits for it). Create it inside the running loop.
    """

    def __init__(self, lines: Iterator[bytes]) -> None:
        self._lines = lines
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._wanted = threading.Semaphore(0)
        threading.Thread(target=self._run, name="run-batch-reader", daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wanted.acquire()
            try:
                item: bytes | BaseException | None = next(self._lines, None)
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                item = e
            try:
                self._loop.call_soon_threadsafe(self._ready.put_nowait, item)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                return
            if not isinstance(item, bytes):
                return

    async def next(self) -> bytes | None:
        """The next line, or None at the end.

        Raises:
            OSError: (or what else the iterator raised) when reading failed.
        """
        self._wanted.release()
        item = await self._ready.get()
        if isinstance(item, BaseException):
            raise item
        return item
