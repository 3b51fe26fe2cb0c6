"""vLLM KV connector: ``kv_connector="KVStageConnector"``, ``kv_connector_module_path="kvstage.plugin.vllm"``.

- ``connector``: ``KVStageConnector`` (scheduler and worker sides; imports vLLM);
- ``layout``: vLLM's per-layer KV caches described with kvstage's types;
- ``pull``: the decode's "send me request R" to the prefill ranks.

The connector is imported on first use, so ``layout`` and ``pull`` load without vLLM.
"""

_CONNECTOR = ("KVStageConnector", "KVStageMeta")


def __getattr__(name: str):
    if name in _CONNECTOR:
        from kvstage.plugin.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvstage.plugin.vllm' has no attribute {name!r}")


__all__ = list(_CONNECTOR)
