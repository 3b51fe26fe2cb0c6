"""Transports: ``nixl`` (one-sided, NIXL/UCX), ``ucx`` (two-sided, UCXX) and ``cma``
(one-sided, same host, host memory: ``process_vm_writev``)."""


def make_transport(name: str, label: str):
    """A transport by its ``Settings.transport`` name; raises TransportError if it cannot start."""
    if name == "nixl":
        from kvstage.transports.nixl import NixlTransport

        return NixlTransport(label)
    if name == "ucx":
        from kvstage.transports.ucx import UcxTransport

        return UcxTransport(label)
    if name == "cma":
        from kvstage.transports.cma import CmaTransport

        return CmaTransport(label)
    from kvstage.errors import ConfigError

    raise ConfigError(f"transport={name!r}: must be nixl, ucx or cma")
