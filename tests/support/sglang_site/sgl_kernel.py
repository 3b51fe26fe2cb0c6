"""Stand-in for ``sgl_kernel`` in the CPU server tests (never shipped).

SGLang 0.5.23 imports ``sgl_kernel`` at module level on its CPU path, and no
pip wheel carries its CPU ops. The servers here run the native torch paths;
the one op they call is ``assign_req_to_token_pool_cpu``, written below in
torch with the semantics of SGLang's triton kernel of the same name. Every
other name imports but raises when called, so a path that needs a real kernel
fails loudly instead of computing something else.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+kvstage-tests"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[at:at + end[i] - start[i]]``,
    ``at`` the sum of the lengths before ``i``."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len={pool_len}, req_to_token has {req_to_token.shape[1]} columns")
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[at:at + n].to(req_to_token.dtype)
        at += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: the CPU test stand-in has no such op "
                                  "(tests/support/sglang_site/sgl_kernel.py)")

    missing.__name__ = name
    return missing
