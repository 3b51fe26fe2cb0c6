"""SGLang plugin: ``--disaggregation-transfer-backend kvstage`` without patching SGLang.

SGLang (0.5.23) loads entry points of group ``sglang.srt.plugins`` early in
every process (``sglang.srt.plugins.load_plugins``) and then applies the hooks
they registered. ``register`` (the entry point, see pyproject.toml):

1. adds ``kvstage`` to the CLI's transfer-backend choices;
2. adds a real ``TransferBackend.KVSTAGE`` member, so ``TransferBackend("kvstage")``
   resolves wherever SGLang converts the CLI string;
3. wraps ``get_kv_class`` (an AROUND hook) to return kvstage's manager, sender,
   receiver and bootstrap server for ``kvstage`` and call through for every
   other backend.

This module stays light (it runs in the tokenizer and detokenizer processes
too); the classes in ``conn`` (and the role modules behind it) are imported on
first use.
"""

from __future__ import annotations

import enum
from typing import Any

NAME = "kvstage"
MEMBER = "KVSTAGE"
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def add_enum_member(cls: type[enum.Enum], name: str, value) -> enum.Enum:
    """Add ``name = value`` to an existing Enum in place; existing members stay identical."""
    existing = cls._value2member_map_.get(value)
    if existing is not None:
        return existing
    member: Any = object.__new__(cls)  # Enum's private fields, set by hand as EnumType sets them (not typed)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls
    if hasattr(cls, "_sort_order_"):
        member._sort_order_ = len(cls._member_names_)
    cls._member_map_[name] = member
    cls._member_names_.append(name)
    cls._value2member_map_[value] = member
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to rebind members
    return member


def kv_class(original, transfer_backend, class_type):
    """AROUND hook on SGLang's ``get_kv_class``."""
    if getattr(transfer_backend, "value", transfer_backend) != NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from kvstage.plugin.sglang import conn

    return {
        KVClassType.MANAGER: conn.KVStageManager,
        KVClassType.SENDER: conn.KVStageSender,
        KVClassType.RECEIVER: conn.KVStageReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KVStageBootstrapServer,
    }.get(class_type)


def register() -> None:
    """Entry point of group ``sglang.srt.plugins`` (idempotent)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    add_enum_member(TransferBackend, MEMBER, NAME)
    if not any(hook is kv_class for _, hook, _ in HookRegistry._hooks.get(GET_KV_CLASS, ())):
        HookRegistry.register(GET_KV_CLASS, kv_class, HookType.AROUND)
