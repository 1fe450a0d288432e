"""Flag checks shared by the ``kvflow bench`` commands, run before any model is loaded or any
request sent, so a typo costs no waiting. Each raises ValueError naming the flag (the CLI
prints it and exits with status 2)."""

from __future__ import annotations

import math
import os


def require_positive(**flags: float | None) -> None:
    """Every given value must be a number > 0 (inf allowed, NaN not); None means "not given".
    Keyword names are flag names with ``_`` for ``-`` (``num_prompts`` -> ``--num-prompts``).

    Raises:
        ValueError: naming the first flag that is not.
    """
    for name, value in flags.items():
        if value is not None and not value > 0:  # NaN fails the comparison too
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def require_fits(max_model_len: int, input_len: int, output_len: int) -> None:
    """The offline benchmarks count ``output_len`` tokens per prompt (EOS ignored): a prompt
    plus its output must fit in the engine's ``max_model_len``, else generation stops early
    and every per-token figure is computed over tokens never generated.

    Raises:
        ValueError: naming ``--input-len`` and ``--output-len`` when they do not fit.
    """
    if input_len + output_len > max_model_len:
        raise ValueError(f"--input-len {input_len} + --output-len {output_len} = "
                         f"{input_len + output_len} tokens exceed the engine's max_model_len "
                         f"{max_model_len}: lower them or raise --max-model-len")


def require_one_engine(data_parallel_size: int, command: str) -> None:
    """The offline benchmarks time one in-process engine: no data-parallel replicas.

    Raises:
        ValueError: naming ``--data-parallel-size`` when it is above 1.
    """
    if data_parallel_size > 1:
        raise ValueError(f"--data-parallel-size {data_parallel_size}: kvflow bench {command} "
                         "times one engine; run kvflow bench serve against kvflow serve "
                         "--data-parallel-size N instead")


def parse_positive_ints(spec: str, flag: str) -> list[int]:
    """``"1,8,32"`` -> [1, 8, 32]. Raises ValueError naming ``flag`` for anything else."""
    try:
        values = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be positive integers, comma-separated; got {spec!r}")
    return values


def ensure_parent_dir(path: str | None, flag: str) -> None:
    """Check that ``path`` (an output file named by ``flag``) can be written, creating its
    folder if needed, so a long run does not end in an error that loses its results.

    Raises:
        ValueError: when ``path`` is a folder or its folder cannot be created.
    """
    if not path:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder; give a file name")
    folder = os.path.dirname(path)
    if folder and not os.path.isdir(folder):
        if os.path.exists(folder):
            raise ValueError(f"{flag} {path}: {folder} is not a folder")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot create its folder ({e.strerror})") from e


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of an input file named by ``flag``.

    Raises:
        ValueError: naming the flag and the file when it cannot be read (missing, a folder, no
            permission) or is not UTF-8 text.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {e.start}: {e.reason}); is it "
                         "a binary file?") from None


def is_finite_positive(value: float) -> bool:
    """Whether ``value`` is a number in (0, inf): not NaN, not infinite."""
    return 0 < value < math.inf
