"""Disaggregated prefill / KV transfer (``KVTransferConfig``, vLLM's ``--kv-transfer-config``
keys): which KV connector the engine runs, in which role, and its connector-specific keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.config.options import json_config_dict, unknown_fields

KV_CONNECTORS = ("SharedStorageConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# vLLM's other connectors: named in the refusal, so a copied command line says what is missing
VLLM_ONLY_CONNECTORS = ("NixlConnector", "P2pNcclConnector", "LMCacheConnectorV1",
                        "LMCacheMPConnector", "MultiConnector", "OffloadingConnector",
                        "DecodeBenchConnector", "MooncakeConnector")
# SharedStorageConnector's keys in kv_connector_extra_config, with their defaults
SHARED_STORAGE_KEYS = {"shared_storage_path": "/tmp"}


@dataclass
class KVTransferConfig:
    """KV transfer between engines (``--kv-transfer-config`` JSON /
    ``LLM(kv_transfer_config=...)``): a prefill instance saves each request's prompt KV blocks,
    a decode instance with the same model loads them instead of recomputing them
    (``kvflow/distributed/kv_transfer/``).

    Attributes:
        kv_connector: the connector's name; only ``SharedStorageConnector`` (vLLM's example
            connector: one safetensors file per KV block in a shared folder).
        kv_role: ``kv_producer`` (saves the KV its prefills compute), ``kv_consumer`` (loads
            the KV found in storage) or ``kv_both`` (both).
        kv_connector_extra_config: the connector's own keys; SharedStorageConnector reads
            ``shared_storage_path`` (the folder, created if missing; default ``/tmp``).
        kv_load_failure_policy: what a block that cannot be loaded (its file gone, corrupt
            or of another layout) does: ``recompute`` (the default, as vLLM's: its request
            computes it and what follows) or ``fail`` (the step fails, its requests are
            aborted).

    Raises:
        ValueError: from the constructor, naming the field, for a missing or unknown
            connector (vLLM's other connectors are named as not available), an unknown role,
            or an unknown or mistyped extra key.
    """

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        name = self.kv_connector
        if name in VLLM_ONLY_CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector={name!r} is not available in "
                             f"kvflow; available: {list(KV_CONNECTORS)}")
        if name not in KV_CONNECTORS:
            raise ValueError(f"kv_transfer_config kv_connector={name!r} is unknown; "
                             f"choose one of {list(KV_CONNECTORS)}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config kv_role={self.kv_role!r} is invalid; "
                             f"choose one of {list(KV_ROLES)}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_transfer_config kv_load_failure_policy="
                             f"{self.kv_load_failure_policy!r} is invalid; choose one of "
                             f"{list(KV_LOAD_FAILURE_POLICIES)}")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError throughout kvflow)
                f"kv_transfer_config kv_connector_extra_config={extra!r} must be a JSON object")
        unknown = sorted(set(extra) - set(SHARED_STORAGE_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config has unknown "
                             f"key(s) {unknown} for {name}; valid: {sorted(SHARED_STORAGE_KEYS)}")
        path = extra.get("shared_storage_path", SHARED_STORAGE_KEYS["shared_storage_path"])
        if not isinstance(path, str) or not path:
            raise ValueError(f"kv_transfer_config kv_connector_extra_config "
                             f"shared_storage_path={path!r} must be a non-empty folder path")

    @property
    def is_producer(self) -> bool:
        """Whether this engine saves the KV it computes (kv_producer, kv_both)."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Whether this engine loads KV found in storage (kv_consumer, kv_both)."""
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def shared_storage_path(self) -> str:
        """SharedStorageConnector's folder."""
        return self.kv_connector_extra_config.get("shared_storage_path",
                                                  SHARED_STORAGE_KEYS["shared_storage_path"])

    @classmethod
    def from_value(cls, value: KVTransferConfig | dict | str | None) -> KVTransferConfig | None:
        """A config from a dict, a JSON object string (the flag's form) or None (off; so is
        the JSON text ``null``).

        Raises:
            ValueError: for text that is not a JSON object, an unknown key (named; vLLM's
                keys kvflow does not read are named as such), or a bad value (see the class).
        """
        if value is None or isinstance(value, cls):
            return value
        value = json_config_dict("kv_transfer_config", value, '{"kv_connector": '
                                 '"SharedStorageConnector", "kv_role": "kv_both"}')
        if value is None:
            return None
        unknown, known = unknown_fields(cls, value)
        if unknown:
            raise ValueError(f"kv_transfer_config has unknown or unsupported key(s) {unknown}; "
                             f"kvflow reads {known}")
        return cls(**value)
