"""Where a chat template comes from, checked before it is used: a ``--chat-template`` value
(a Jinja file, or the template itself, as vLLM's flag takes it) read and compiled at start-up,
and the model's own template compiled at start-up so that a broken one is reported then, not
on the first chat request. Rendering lives in ``kvflow/chat/template.py``.
"""

from __future__ import annotations

import logging
import os
import select
import stat
import time
from typing import Any

__all__ = ["load_chat_template", "model_template_warning", "template_name",
           "template_syntax_error", "warn_if_model_template_broken"]

logger = logging.getLogger(__name__)

FLAG = "--chat-template"
# A value that is no file is taken as the template itself only if it holds Jinja markup: a
# statement, an expression or a comment. A value without any (``chat.jinja`` misspelled, or a
# path in a folder that does not exist) is a missing file, never a template that renders its
# own name (vLLM's rule, stricter: vLLM takes any ``{``, ``}`` or newline).
_JINJA_MARKERS = ("{%", "{{", "{#")
MAX_TEMPLATE_BYTES = 1 << 20  # the largest template file read (published ones: under 20 KiB)
PIPE_WAIT_S = 10.0  # how long a pipe (``<(cat t.jinja)``, a FIFO) may take to send its template


def load_chat_template(value: str) -> str:
    """The Jinja chat template a ``--chat-template`` value names, compiled once as a check.

    Args:
        value: the path of a file holding the template (UTF-8, a byte-order mark dropped;
            relative to the working directory), or, when no such path exists, the template
            text itself, which must then hold Jinja markup (``{%``, ``{{`` or ``{#``).

    Returns:
        The template text, as ``apply_chat_template(chat_template=...)`` takes it.

    Raises:
        ValueError: for a value that is no string or is empty; starting
            ``--chat-template VALUE:`` (an inline template is named
            ``<inline template>``) for a path that does not exist (and no Jinja markup), a
            file that cannot be read (a folder, no permission), is not UTF-8 or is empty (or
            blank), a pipe that sends nothing for :data:`PIPE_WAIT_S` s, or a template that does not compile (naming its Jinja line).
    """
    if not isinstance(value, str) or not value:
        raise ValueError(f"{FLAG} must be a file's path or a template's text, got {value!r}")
    where = f"{FLAG} {template_name(value)}"
    if os.path.exists(value):
        template = _read_template_file(value)
    elif any(marker in value for marker in _JINJA_MARKERS):
        template = value
    else:
        raise ValueError(f"{where}: no such file (a template given inline, not as a file, "
                         "must hold Jinja markup: {%, {{ or {#)")
    if not template.strip():  # only a file can be: an inline template holds markup
        raise ValueError(f"{where}: the file is empty" + (" (blank)" if template else ""))
    error = template_syntax_error(template)
    if error is not None:
        raise ValueError(f"{where}: not a valid Jinja template (line {error.lineno}: "
                         f"{error.message})")
    return template


def template_name(value: str) -> str:
    """How messages name a ``--chat-template`` value: the file's path, or ``<inline
    template>`` for the template itself."""
    return value if os.path.exists(value) or not any(m in value for m in _JINJA_MARKERS) \
        else "<inline template>"


def _read_template_file(path: str) -> str:
    """The text of ``path`` (a file, or a pipe read by :func:`_read_pipe`). Raises ValueError
    naming the flag and the file when it cannot be read, is larger than
    :data:`MAX_TEMPLATE_BYTES`, is not UTF-8 or is a pipe that sends nothing."""
    try:
        if stat.S_ISFIFO(os.stat(path).st_mode):
            data = _read_pipe(path)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_TEMPLATE_BYTES + 1)  # /dev/zero named by mistake ends here
    except OSError as e:
        raise ValueError(f"{FLAG} {path}: cannot read it ({e.strerror})") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"{FLAG} {path}: larger than {MAX_TEMPLATE_BYTES >> 20} MiB, not a "
                         "chat template (those are a few KiB)")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{FLAG} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at "
                         f"offset {e.start})") from None


def _read_pipe(path: str) -> bytes:
    """Up to ``MAX_TEMPLATE_BYTES + 1`` bytes of the pipe ``path`` (a FIFO, or bash's
    ``<(...)``), read until its writer closes it. Opened without blocking, so a FIFO that
    nothing writes to, or a writer that never closes it, cannot hang start-up: raises
    ValueError when no byte or end comes for :data:`PIPE_WAIT_S` seconds (OSError as ``open``
    would)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        chunks: list[bytes] = []
        size, deadline = 0, time.monotonic() + PIPE_WAIT_S
        while size <= MAX_TEMPLATE_BYTES:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise ValueError(f"{FLAG} {path}: " + (
                    f"a pipe that sent {size} bytes but was not closed within "
                    f"{PIPE_WAIT_S:g} s (is its writer still running?)" if size else
                    f"a pipe that sent no template within {PIPE_WAIT_S:g} s (nothing "
                    "writing to it?)"))
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:  # woken without data: wait again
                continue
            if not chunk:  # the writer closed it
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def template_syntax_error(template: str) -> Any:
    """The ``jinja2.TemplateSyntaxError`` of a chat template that does not compile, None when
    it compiles. Compiled as ``apply_chat_template`` compiles it (transformers' sandboxed
    environment, with its loop controls and ``{% generation %}`` tag), so a template passes
    exactly when rendering can start."""
    import jinja2

    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        return e
    return None


def _compile(template: str) -> None:
    try:  # private, but the one compiler apply_chat_template renders with (cached there)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that moved it: Jinja's sandbox, loop controls on
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        return
    _compile_jinja_template(template)


def model_template_warning(tokenizer: Any) -> str | None:
    """The start-up warning for a model whose own chat template does not compile (every chat
    request would get a 400 saying so; completions are unaffected), None when it compiles,
    or the model has none, or there is no tokenizer. A tokenizer holding named templates (a
    dict) has each checked."""
    from kvflow.chat.template import syntax_error_message

    templates = getattr(tokenizer, "chat_template", None)
    named = templates.items() if isinstance(templates, dict) else [(None, templates)]
    for name, template in named:
        error = template_syntax_error(template) if isinstance(template, str) and \
            template else None
        if error is not None:
            which = "" if name is None else f" (the template named {name!r})"
            return (f"{syntax_error_message(error, 'model')}{which}, or serve another "
                    f"with {FLAG}; chat requests get a 400 until then, completions are served")
    return None


def warn_if_model_template_broken(tokenizer: Any) -> None:
    """Log :func:`model_template_warning` as a warning, if any (nothing for a template that
    compiles, a model without one, or no tokenizer: None). For a server without
    ``--chat-template``: ``run_server`` passes it to AsyncLLM as ``on_tokenizer``, so it is
    logged once the tokenizer is loaded, while the model still loads."""
    warning = model_template_warning(tokenizer)
    if warning is not None:
        logger.warning(warning)
