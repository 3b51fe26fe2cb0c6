"""The one line the transfer engine logs per peer when it connects.

No subprocess and no UCX capture: it judges from the two sides' facts (as
``facts.collect_local`` returns them, exchanged in the handshake), the name the
transport gives for its path, and a bandwidth if the engine measured one.
What it cannot observe it labels ``expected``. Log it with ``finding.log(logger)``
and log no other link warning.
"""

from __future__ import annotations

from kvstage.link import paths
from kvstage.link.assess import assess
from kvstage.link.finding import Finding

# Names that say which library moves the bytes, not which UCX transport.
_OPAQUE = {"", "nixl", "ucx", "ucxx", "auto"}
# kvstage's own transports, whose path is known by construction (no UCX inside)
_OWN = {"cma": "kvstage's cma transport (process_vm_writev, no UCX)"}


def connect_line(
    local_facts: dict,
    peer_facts: dict | None,
    transport_name: str,
    measured_gbps: float | None,
    peer_name: str | None = None,
) -> Finding:
    """Finding for one peer at connect time (see module doc)."""
    name = (transport_name or "").strip()
    selection = None
    if name.lower() in _OWN:
        selection = {
            "summary": name.lower(),
            "transports": [name.lower()],
            "descriptions": [],
            "mover": _OWN[name.lower()],
        }
    elif name.lower() not in _OPAQUE:
        tls = paths.transports_in(name)
        selection = {
            "summary": name,
            "transports": tls,
            "descriptions": ["software emulation"] if "emulation" in name else [],
        }
    if peer_name is None:
        host = ((peer_facts or {}).get("host") or {}).get("value") or {}
        pid = ((peer_facts or {}).get("pid") or {}).get("value")
        peer_name = f"{host.get('hostname', 'peer')}" + (f" pid {pid}" if pid else "")
    return assess(local_facts, peer_facts, selection, measured_gbps, peer_name=peer_name, selection_source="queried")
