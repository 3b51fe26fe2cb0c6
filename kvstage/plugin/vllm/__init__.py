"""vLLM KV connector: ``kv_connector="KVStageConnector"``, ``kv_connector_module_path="kvstage.plugin.vllm"``.

- ``connector``: ``KVStageConnector``, the facade vLLM loads (imports vLLM);
- ``scheduler``, ``worker``: its two roles; ``meta``: what they share;
- ``layout``: vLLM's per-layer KV caches described with kvstage's types;
- ``pull``: a decode rank's "connect to me" to a prefill rank not connected yet;
- ``stats``: kvstage's figures in vLLM's connector stats.

The connector is imported on first use, so ``layout`` and ``pull`` load without vLLM
(README.md here gives the reading path).
"""

_CONNECTOR = ("KVStageConnector", "KVStageMeta")


def __getattr__(name: str):
    if name in _CONNECTOR:
        from kvstage.plugin.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvstage.plugin.vllm' has no attribute {name!r}")


__all__ = list(_CONNECTOR)
