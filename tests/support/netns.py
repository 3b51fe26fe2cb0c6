"""Two network namespaces joined by a veth pair, for tests that need two
"hosts" on one machine (the two-host bench, the link cut of the fault suite).

Needs root and ``ip netns``; where either is missing the fixture skips and
says why. The namespaces and the veth pair exist only for the test and only
carry traffic between themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

DST_IP, SRC_IP = "10.77.0.1", "10.77.0.2"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


@dataclass(frozen=True)
class NetnsPair:
    dst: str  # namespace holding DST_IP
    src: str  # namespace holding SRC_IP
    dst_dev: str  # the veth end in ``dst``
    src_dev: str  # the veth end in ``src``

    def exec(self, ns: str) -> list[str]:
        """Command prefix that runs a program inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def link(self, up: bool, side: str = "src") -> None:
        """Set one end of the veth pair up or down (``side``: "src" or "dst")."""
        ns, dev = (self.src, self.src_dev) if side == "src" else (self.dst, self.dst_dev)
        ip("-n", ns, "link", "set", dev, "up" if up else "down")

    def rx_bytes(self, side: str = "dst") -> int:
        """Bytes received so far on one end of the veth pair."""
        ns, dev = (self.src, self.src_dev) if side == "src" else (self.dst, self.dst_dev)
        return int(ip("netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/rx_bytes").stdout)


@pytest.fixture
def netns_pair():
    """Two namespaces joined by a veth pair: DST_IP/24 in ``dst``, SRC_IP/24 in ``src``."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid() % 100000}"
    pair = NetnsPair(f"kvbd{tag}", f"kvbs{tag}", f"vd{tag}", f"vs{tag}")
    probe = ip("netns", "add", pair.dst, check=False)
    if probe.returncode != 0:
        pytest.skip(f"`ip netns add` is not permitted here: {probe.stderr.strip()}")
    try:
        ip("netns", "add", pair.src)
        ip("link", "add", pair.dst_dev, "type", "veth", "peer", "name", pair.src_dev)
        for ns, dev, addr in ((pair.dst, pair.dst_dev, DST_IP), (pair.src, pair.src_dev, SRC_IP)):
            ip("link", "set", dev, "netns", ns)
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield pair
    finally:
        for ns in (pair.dst, pair.src):  # deleting a namespace deletes its end of the veth pair, and so the pair
            ip("netns", "del", ns, check=False)
