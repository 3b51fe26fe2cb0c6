"""kvstage: move an LLM's KV cache from prefill workers to decode workers with
different tensor-parallel sizes, staged, byte-exact, over NIXL, UCX (UCXX) or cma.

The public API is importable from here::

    from kvstage import Destination, KVGeometry, PageLayout, RankCache, SideSpec, Source

Names are imported on first use, so ``import kvstage`` stays cheap for the
command line and the engine plugins' entry points. Layers, each using only
those before it: ``layout`` -> ``tp`` -> ``link`` -> ``transports`` ->
``staging`` -> ``protocol`` -> ``plugin`` / ``bench`` / ``probe``.
"""

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "KVGeometry": "kvstage.layout",
    "PageLayout": "kvstage.layout",
    "SideSpec": "kvstage.tp",
    "TransferPlan": "kvstage.tp",
    "plan": "kvstage.tp",
    "Settings": "kvstage.config",
    "RankCache": "kvstage.staging.cache",
    "Source": "kvstage.protocol.source",
    "Destination": "kvstage.protocol.destination",
    "TransferHandle": "kvstage.protocol.request",
    "State": "kvstage.protocol.request",
    "KVStageError": "kvstage.errors",
    "ConfigError": "kvstage.errors",
    "IncompatibleGeometry": "kvstage.errors",
    "TransportError": "kvstage.errors",
    "ProtocolError": "kvstage.errors",
    "TransferFailed": "kvstage.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstage' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
