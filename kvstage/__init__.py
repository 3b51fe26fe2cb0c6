"""kvstage: move an LLM's KV cache between prefill and decode workers with
different tensor-parallel sizes, staged, byte-exact, over NIXL.

Layers (each uses only those before it): ``layout`` -> ``tp`` ->
``transports`` -> ``staging`` -> ``protocol`` -> ``plugin`` / ``bench`` / ``probe``.
"""

__version__ = "0.1.0"
