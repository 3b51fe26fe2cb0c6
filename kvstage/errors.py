"""Errors kvstage raises. Each message names the field, the value and the rule."""


class KVStageError(Exception):
    """Base of every error kvstage raises on purpose."""


class ConfigError(KVStageError, ValueError):
    """A setting or a geometry is invalid on its own."""


class IncompatibleGeometry(KVStageError, ValueError):
    """The two sides of a transfer cannot be paired (checked before any memory is touched)."""


class TransportError(KVStageError):
    """The transport failed a registration, a connection or a write."""


class MappingError(KVStageError):
    """A peer's shared memory (an arena, KV buffers, an event) cannot be mapped here; the reason says why."""


class ProtocolError(KVStageError):
    """A peer sent a message that breaks the protocol (malformed, out of bounds, wrong state)."""


class TransferFailed(KVStageError):
    """A request failed. ``peer``, ``stage`` and ``cause`` say where and why."""

    def __init__(self, request: str, peer: str, stage: str, cause: str):
        self.request, self.peer, self.stage, self.cause = request, peer, stage, cause
        super().__init__(f"request {request!r} failed at stage {stage} with peer {peer}: {cause}")
