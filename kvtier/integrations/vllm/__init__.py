"""vLLM's KV-connector API on any kvtier backend: ``KvtierConnector``.

vLLM loads it with (``docs/vllm.md`` has the full command line)::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"kvtier": {"backend": "file",
                                               "extra_config": {"root": "/mnt/kv"}}}}'

Importing this package does not import vLLM; ``KvtierConnector`` (and the classes vLLM
exchanges with it) are loaded from :mod:`kvtier.integrations.vllm.connector` on first
access, which needs vLLM (the ``vllm`` extra). The ``kvtier`` section
(:class:`~kvtier.integrations.vllm.settings.VLLMSection`) is validated without vLLM.
"""

from __future__ import annotations

from typing import Any

from kvtier.integrations.vllm.settings import SECTION, VLLMSection, read_section

__all__ = [
    "SECTION",
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "KvtierWorkerMetadata",
    "VLLMSection",
    "read_section",
]

_LAZY = {
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "KvtierConnectorStats",
    "KvtierWorkerMetadata",
}


def __getattr__(name: str) -> Any:
    """Load the vLLM classes on first use, so that importing kvtier never needs vLLM."""
    if name in _LAZY:
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
