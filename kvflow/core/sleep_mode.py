"""The engine core's side of sleep mode (``--enable-sleep-mode``; vLLM's ``LLM.sleep`` /
``wake_up`` / ``collective_rpc("reload_weights")``).

The core owns the rule that makes sleeping safe: only an idle engine sleeps (no request
running or waiting: their KV blocks would be freed under them), and its prefix cache is
reset first (the cached blocks point into KV tensors that are about to be freed). While any
tag sleeps, and after a level-2 sleep until the weights are reloaded, new requests are
refused with a message that says what to call. The workers do the freeing
(``worker/sleep_mode.py``), through the executor, so every rank of every executor sleeps.
"""

from __future__ import annotations

import logging
from typing import Any

from kvflow.worker.sleep_mode import SLEEP_TAGS, WEIGHTS, check_sleep_level, check_wake_tags
from kvflow.worker.worker import RpcRefusal, Worker

logger = logging.getLogger(__name__)


class EngineSleep:
    """Which tags of one engine sleep, at which level, and whether its weights need a reload.

    Args:
        enabled: ``enable_sleep_mode``.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.asleep: set[str] = set()
        self.level: int | None = None
        self.weights_dropped = False  # level 2 until reload_weights
        self.falling_asleep = False  # the API process's mirror: a sleep call is under way

    @property
    def is_sleeping(self) -> bool:
        """True from ``sleep`` until every tag woke up."""
        return bool(self.asleep)

    def refusal(self) -> str | None:
        """Why a new request cannot run now (None: it can)."""
        if self.falling_asleep:
            return ("the engine is going to sleep (a sleep call is under way): call "
                    "wake_up() (POST /wake_up) once it returned")
        if self.asleep:
            return (f"the engine is asleep (sleep level {self.level}; sleeping: "
                    f"{sorted(self.asleep)}): call wake_up() (POST /wake_up) first")
        if self.weights_dropped:
            return ("the engine's weights were dropped (by sleep(level=2), or a "
                    "reload_weights whose load failed): reload them with "
                    "collective_rpc('reload_weights') (or a weight update) first")
        return None

    def sleep(self, core: Any, level: int) -> None:
        """Put ``core``'s workers to sleep; a no-op (logged) if they sleep already.

        Raises:
            ValueError: without ``enable_sleep_mode``, for a level other than 1 and 2, or
                while requests are running or waiting.
        """
        level = check_sleep_level(level)
        if not self.enabled:
            raise ValueError("sleep mode needs an engine started with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if self.asleep:
            logger.warning("sleep(level=%d): the engine is asleep already (level %s)", level,
                           self.level)
            return
        busy = core.scheduler.num_running + core.scheduler.num_waiting
        if core.has_unfinished_requests():
            raise ValueError(f"cannot sleep with {busy} request(s) in flight: sleep needs an "
                             "idle engine (wait for them to finish, or abort them)")
        core.reset_prefix_cache()  # its blocks point into freed tensors
        _forget_images(core)  # the runners drop their encoder outputs too
        core.executor.collective_rpc("sleep", level)
        self.record_sleep(level)
        logger.info("engine asleep (level %d)", level)

    def record_sleep(self, level: int) -> None:
        """Note a sleep at ``level`` that the workers did (the API process's mirror calls it
        once every replica answered)."""
        if not self.asleep:
            self.asleep, self.level = set(SLEEP_TAGS), level
            self.weights_dropped = self.weights_dropped or level == 2

    def record_wake_up(self, tags: tuple[str, ...]) -> None:
        """Note that ``tags`` woke up."""
        self.asleep -= set(tags)
        if not self.asleep:
            self.level = None

    def wake_up(self, core: Any, tags: list[str] | None) -> None:
        """Wake ``tags`` ("weights", "kv_cache"; None: both) on every worker; a no-op
        (logged) if the engine is awake.

        Raises:
            ValueError: for an unknown tag.
        """
        wanted = check_wake_tags(tags)
        if not self.asleep:
            logger.warning("wake_up(tags=%s): the engine is not asleep", tags)
            return
        core.executor.collective_rpc("wake_up", list(wanted))
        self.record_wake_up(wanted)

    def collective_rpc(self, core: Any, method: Any, args: tuple,
                       kwargs: dict | None) -> list[Any]:
        """``Worker.<method>(*args, **kwargs)`` on every rank, results by rank; ``method`` may
        be a callable (run as ``method(worker, *args, **kwargs)``) only where the workers
        run in this process.

        ``reload_weights`` builds new models: the images the encoder-cache mirror lists
        are gone from the ranks (they drop their models' caches), and the prefix cache's
        K/V were computed by the old weights (the checkpoint may have changed), so both are
        forgotten (the prefix cache with the blocks requests hold: ``weights_changed``). A
        reload that
        fails leaves the ranks without weights: requests are refused until one succeeds.

        Raises:
            ValueError: for a name that is not a Worker method, a callable with worker
                processes, ``args`` that are not a tuple or list, or ``kwargs`` that are
                not a dict; ``reload_weights`` while the weights sleep; whatever the method
                raised on a rank (its message).
        """
        if callable(method) and not core.executor.runs_in_process:
            raise ValueError("collective_rpc: a callable can run only with the in-process "
                             "executor (distributed_executor_backend='uni'); name a Worker "
                             "method instead")
        if not isinstance(args, (tuple, list)):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"collective_rpc args={args!r} must be a tuple")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"collective_rpc kwargs={kwargs!r} must be a dict")
        if method == "reload_weights" and WEIGHTS in self.asleep:
            raise ValueError("reload_weights: the weights are asleep; call "
                             "wake_up(tags=['weights']) first")
        if not callable(method):
            Worker.check_method(method)  # before it reaches a worker process
        reload = method == "reload_weights"
        if reload:
            _forget_images(core)
        results = core.executor.collective_rpc("run_method", method, tuple(args), kwargs)
        refused = next((r for r in results if isinstance(r, RpcRefusal)), None)
        if refused is not None:
            if reload:  # a rank whose load failed has no model (bad arguments: it kept it)
                self.weights_dropped = weights_missing(core.executor.collective_rpc(
                    "weight_bytes")) or self.weights_dropped
            raise ValueError(f"collective_rpc {refused.message}")
        if reload:
            self.weights_dropped = False
            core.weight_bytes = core.executor.weight_bytes
            core.weights_changed()  # the cached K/V and the stored blocks are the old files'
            if core.kv_event_publisher is not None:
                core.publish_kv_events()
        return results


def weights_missing(weight_bytes: list[int]) -> bool:
    """Whether a rank holds no weights, from ``Worker.weight_bytes`` of every rank (0 once a
    rank let its model go: a level-2 sleep, or a ``reload_weights`` whose load failed)."""
    return 0 in weight_bytes


def _forget_images(core: Any) -> None:
    """Take every image out of ``core``'s encoder-cache mirror (the ranks' caches go with
    their models): a later request encodes its images again."""
    encoder = core.scheduler.encoder
    if encoder is not None:
        encoder.forget(set(encoder.cached))
