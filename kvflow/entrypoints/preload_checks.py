"""What ``kvflow serve`` (and ``kvflow run-batch``) check of the server's flags before the
model loads, so that a value that cannot be used is refused in seconds, not after minutes of
loading: the address to listen on (``--host`` / ``--port``), the ``--uds`` path and the
``--lora-modules`` adapters.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

from kvflow.config import EngineConfig


def check_lora_modules(modules: tuple[str, ...], engine_config: EngineConfig,
                       model_names: tuple[str, ...]) -> None:
    """What ``--lora-modules`` can be told to be wrong before the model loads: the flags,
    and each adapter's folder and ``adapter_config.json`` (a missing folder or file, a rank
    above ``--max-lora-rank``, a LoRA variant kvflow cannot apply). A refusal found only once
    the engine reads the weights is raised by ``start_app``, after the model loaded.

    Raises:
        ValueError: without ``--enable-lora``, for an adapter named like the base model
            (any of ``model_names``, its served names), or
            for an adapter folder or config refused (see
            :func:`kvflow.lora.adapter_config.check_adapter_config`).
    """
    from kvflow.lora.adapter_config import check_adapter_config, read_adapter_config

    if modules and not engine_config.lora_config.enable_lora:
        raise ValueError(f"--lora-modules {' '.join(modules)} needs --enable-lora")
    for module in modules:
        name, _, path = module.partition("=")
        if name in model_names:
            raise ValueError(f"--lora-modules {module}: the adapter is named like the served "
                             f"model {name!r}; give it another name")
        try:
            check_adapter_config(read_adapter_config(path),
                                 engine_config.lora_config.max_lora_rank,
                                 repr(os.path.join(path, "adapter_config.json")), name)
        except ValueError as e:
            raise ValueError(f"--lora-modules {module}: {e}") from None


def check_listen_address(host: str, port: int) -> None:
    """``--host`` resolves and ``--port`` is free on it, checked before the model loads (the
    server binds only after; another process could still take the port in between).

    Raises:
        ValueError: for a host name that does not resolve, or an address that cannot be
            listened on (in use, or a port below 1024 without the right).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    with contextlib.ExitStack() as probes:  # every address, as asyncio's create_server binds
        for family, kind, proto, _, address in dict.fromkeys(infos):
            probe = probes.enter_context(socket.socket(family, kind, proto))
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as e:
                raise ValueError(f"--host {host} --port {port}: cannot listen there "
                                 f"({e.strerror})") from None


def check_socket_path(path: str) -> None:
    """``--uds PATH`` can be bound, checked before the model loads: its folder exists and
    nothing but a (stale) socket is at the path (uvicorn replaces a socket file there).

    Raises:
        ValueError: naming the flag, for a missing folder or another kind of file there.
    """
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--uds {path}: the folder {folder} does not exist")
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ValueError(f"--uds {path}: a file that is not a socket is there; remove it or "
                         "give another path")
