"""The control port against a hostile client on its host: real destinations,
real sockets, real NIXL sources; every loop here is bounded.

What a stranger gets before it authenticates is bounded in time (a deadline,
whatever it sends), size (1 MiB frames, checked from the length prefix), count
(64 connections) and kind (a hello or a probe request only). The accept loop
survives running out of descriptors. A destination without a token makes a
secret of its own, hands it out in its address, and tells a stranger without it
nothing but that authentication failed; it gives no one without a token its KV
regions. Refusals are
logged once per address and cause. Bad API input is refused where it is given.
"""

import json
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from support import fault_ranks as fr
from support.fake_peers import FakeDestination, FakeSource, OneWelcome, welcome_of
from support.port_dst import PREFIX
from kvstage.bench.reference import fill_shard
from kvstage.config import Settings
from kvstage.errors import ConfigError, IncompatibleGeometry, TransferFailed
from kvstage.layout import KVGeometry, PageLayout, pages_needed
from kvstage.protocol import dst_listener
from kvstage.protocol.destination import Destination
from kvstage.protocol.gate import MAX_UNAUTHENTICATED, PRE_AUTH_MAX_FRAME
from kvstage.protocol.address import Address
from kvstage.protocol.handshake import AUTH_FAILED, HANDSHAKE_TIMEOUT_S, spec_to_wire
from kvstage.protocol.request import State
from kvstage.protocol.source import Source
from kvstage.protocol.messages import PROTOCOL_VERSION
from kvstage.staging.cache import RankCache
from kvstage.tp import SideSpec

TESTS = Path(__file__).resolve().parent
from support.procs import CTX  # forked from a warm server, as spawned children were
TOKEN = "s3cret"


def _frame(msg) -> bytes:
    data = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
    return struct.pack("!I", len(data)) + data


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the destination closed ``sock`` within ``seconds`` (what it sent before is skipped)."""
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if sock.recv(1 << 16) == b"":
                return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    return False


def _reply(sock: socket.socket, timeout: float = 5.0) -> dict | None:
    sock.settimeout(timeout)
    try:
        head = sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return None
        return json.loads(sock.recv(struct.unpack("!I", head)[0], socket.MSG_WAITALL))
    except (OSError, ValueError):
        return None


def _dst(**over) -> Destination:
    return Destination(RankCache.allocate(fr.dst_spec(), 0, 128), Settings(**(fr.SETTINGS | {"auth_token": TOKEN} | over)))


def _transfer(address, dst: Destination | None = None, seed: int = 3, tokens: int = 300, token: str = TOKEN,
              remote=None, model: str = ""):
    """One request from a real source to ``address``, checked byte for byte: by ``dst`` in this
    process, or by a ``PortDst`` (``remote``), whose answer is returned. The source stays
    connected until the destination is done."""
    cache = RankCache.allocate(fr.src_spec(1), 0, pages_needed(tokens, 16) + 2)
    pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(tokens, 16)]
    fill_shard(cache, seed, pages, tokens)
    src = Source(cache, Settings(**(fr.SETTINGS | {"auth_token": token})), model=model)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", remote.ask(cmd="expect", tokens=tokens, seed=seed)))
    try:
        if remote:
            t.start()
        src.connect([address if isinstance(address, str) else tuple(address)])
        dpages = np.random.default_rng(seed + 1).permutation(dst.cache.pages)[: pages_needed(tokens, 4)] if dst else None
        hd = dst.expect(f"r{seed}", dpages, tokens) if dst else None
        src.send(f"r{seed}", pages, tokens).wait(30)
        if dst:
            hd.wait(30)
            assert fr.check(dst.cache, seed, dpages, tokens) == []
        if remote:
            t.join(60)
            assert box.get("r") == {"ok": True, "wrong": []}, box
    finally:
        src.close()


class PortDst:
    """tests/support/port_dst.py: a destination in its own process."""

    def __init__(self, cfg: dict, env: dict | None = None):
        self.p = subprocess.Popen([sys.executable, str(TESTS / "support" / "port_dst.py"), json.dumps(cfg)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, KVSTAGE_AUTH_TOKEN=TOKEN, **(env or {})))
        self.port = self._answer()["port"]
        self.address = ("127.0.0.1", self.port)

    def ask(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._answer()

    def _answer(self) -> dict:
        for line in self.p.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        raise AssertionError(f"port_dst exited: {self.p.stderr.read()[-3000:]}")

    def stop(self) -> str:
        """End the process; its log."""
        try:
            self.p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(10)
        return self.p.stderr.read()


# -- 1. the accept loop survives ------------------------------------------------------------------

def _flood(address, n: int = 300) -> list:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(address, timeout=0.5))
        except OSError:  # the backlog is full: the kernel refuses more
            break
    return socks


def test_a_descriptor_flood_cannot_take_the_descriptors_the_transport_needs():
    """300 connections against a process with 40 descriptors to spare. Strangers are held up to a
    quarter of what is left (the oldest dropped for a new one), so UCX's own listener never meets
    EMFILE (when it did, later sources got "Connection refused" from UCX); a real request then
    arrives byte-exact."""
    dst = PortDst({"spare_fds": 40})
    flood = []
    try:
        flood = _flood(dst.address)
        assert len(flood) > 40
        time.sleep(1.5)
        for s in flood:
            s.close()
        flood.clear()
        time.sleep(0.5)
        _transfer(dst.address, seed=5, remote=dst)
    finally:
        for s in flood:
            s.close()
        log = dst.stop()
    assert "dropped for a newer one" in log, log[-3000:]
    assert sum("accept failed" in line for line in log.splitlines()) <= 1, log[-3000:]


def test_the_accept_loop_survives_running_out_of_descriptors():
    """Two descriptors to spare: accepts fail with EMFILE. That used to end the accept thread for
    good, with no log line. Now the failures are one line, the listener backs off and goes on, and
    once the flood closes it accepts (and answers) again, and says so in one line."""
    dst = PortDst({"spare_fds": 2})
    flood = []
    try:
        flood = _flood(dst.address, 40)
        time.sleep(1.5)  # the accept thread meets EMFILE and backs off
        for s in flood:
            s.close()
        flood.clear()
        time.sleep(dst_listener.ACCEPT_QUIET_S + 2.0)  # the burst is over (the backlog drained, then quiet)
        s = socket.create_connection(dst.address)
        s.sendall(_frame(_hello(token="guess")))
        reply = _reply(s)
        s.close()
        assert reply is not None and reply["type"] == "error" and "auth token" in reply["reason"], reply
    finally:
        for s in flood:
            s.close()
        log = dst.stop()
    failed = [line for line in log.splitlines() if "accept failed" in line]
    assert len(failed) == 1 and "Too many open files" in failed[0], log[-3000:]
    assert sum("accepting again after" in line for line in log.splitlines()) == 1, log[-3000:]


# -- 2. a deadline until authenticated, whatever is sent ---------------------------------------------

def test_a_ping_before_authenticating_closes_the_connection():
    """A complete frame used to cancel the handshake deadline: 200 ping-only connections stayed
    open. Now anything but a hello or a probe request first closes the connection."""
    dst = _dst()
    socks = []
    try:
        for _ in range(20):
            s = socket.create_connection(dst.address)
            s.sendall(_frame({"type": "ping"}))
            socks.append(s)
        assert all(_closed_within(s, 2.0) for s in socks)
        _transfer(dst.address, dst)  # still serving
    finally:
        for s in socks:
            s.close()
        dst.close()


def test_an_unfinished_hello_is_dropped_at_the_deadline():
    dst = _dst()
    try:
        s = socket.create_connection(dst.address)
        t0 = time.monotonic()
        s.sendall(struct.pack("!I", 1000) + b"{" * 100)  # a frame begun, never finished
        assert _closed_within(s, HANDSHAKE_TIMEOUT_S + 3)
        assert HANDSHAKE_TIMEOUT_S - 0.2 < time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S + 2
        s.close()
    finally:
        dst.close()


# -- 3. memory before authentication is bounded ------------------------------------------------------

def test_tens_of_huge_unfinished_frames_are_refused_from_their_length_and_memory_stays_bounded():
    """40 connections each announce a 15 MiB frame and send 4 MiB of it: the destination used to
    buffer them all (600 MB after 40). A stranger's frame is at most 1 MiB, checked from the prefix."""
    dst = PortDst({})
    socks = []
    try:
        before = dst.ask(cmd="rss")["rss"]
        chunk = b"x" * (1 << 20)
        for _ in range(40):
            s = socket.create_connection(dst.address)
            socks.append(s)
            try:
                s.sendall(struct.pack("!I", 15 << 20))
                for _ in range(4):
                    s.sendall(chunk)
            except OSError:  # closed by the destination as soon as it read the length
                pass
        assert all(_closed_within(s, 3.0) for s in socks)
        grown = dst.ask(cmd="rss")["rss"] - before
        assert grown < 32 << 20, f"the destination grew by {grown / 2**20:.0f} MiB"
        # frames within the cap, unfinished: held until the deadline, at most the cap each
        held = []
        for _ in range(40):
            s = socket.create_connection(dst.address)
            s.sendall(struct.pack("!I", PRE_AUTH_MAX_FRAME) + chunk[: PRE_AUTH_MAX_FRAME - 1])
            held.append(s)
        socks += held
        time.sleep(0.5)
        grown = dst.ask(cmd="rss")["rss"] - before
        assert grown < (40 * PRE_AUTH_MAX_FRAME) + (48 << 20), f"the destination grew by {grown / 2**20:.0f} MiB"
        assert all(_closed_within(s, HANDSHAKE_TIMEOUT_S + 3) for s in held)
        _transfer(dst.address, seed=6, remote=dst)
    finally:
        for s in socks:
            s.close()
        dst.stop()


def test_at_most_64_strangers_are_held_the_oldest_dropped_first(caplog):
    dst = _dst()
    socks = []
    try:
        with caplog.at_level(logging.WARNING, logger="kvstage"):
            for _ in range(MAX_UNAUTHENTICATED + 6):
                socks.append(socket.create_connection(dst.address))
                time.sleep(0.005)  # accepted in this order
            assert all(_closed_within(s, 2.0) for s in socks[:6])
            assert not any(_closed_within(s, 0.05) for s in socks[6:])
        lines = [r for r in caplog.records if "dropped for a newer one" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]  # one line for the burst, not six
        for s in socks:
            s.close()
        _transfer(dst.address, dst)
    finally:
        for s in socks:
            s.close()
        dst.close()


# -- 4. no KV regions and no slots for a peer without the token ------------------------------------

def _hello(**over) -> dict:
    spec = SideSpec(fr.GEO, 1, PageLayout(4))  # equal TP and paging: the direct path applies
    msg = {"type": "hello", "version": PROTOCOL_VERSION, "token": "", "engine": "", "model": "", "uid": os.getuid(),
           "spec": spec_to_wire(spec), "rank": 0, "agent": "stranger", "transport": "nixl", "metadata": "",
           "slot_bytes": 1 << 14, "facts": {}, "kv_facts": {}, "paths": ["read", "pages", "direct", "ipc"], "nonce": "n"}
    return msg | over


def test_without_a_token_no_kv_pages_are_offered_and_requests_go_by_the_read_path():
    """A source's KV pages (the ipc, direct and pages paths) are read only by a peer that presented the
    token. A destination without one allows a source the read path only, and proves nothing; a source
    without one offers its arena alone, whatever paths a destination claims. A tokenless request then
    lands byte-exact by the read path (one that could go direct with a token)."""
    dst = _dst(auth_token="")
    try:  # it admits a source presenting the secret of its address, proves it (FakeSource checks), and allows read
        fake = FakeSource(dst.address, token=dst.address.secret, paths=("read", "pages", "direct", "ipc"))
        assert dst.address.secret and fake.paths == ["read"] and fake.welcome.proof is not None
        fake.close()
    finally:
        dst.close()
    claims = ("read", "pages", "direct", "ipc")  # a destination that claims every path, with or without a token
    for token, kv in (("", 0), (TOKEN, fr.GEO.buffers)):
        fake = FakeDestination(token=token, paths=claims, path="auto")
        try:
            assert len(fake.offer.kv) == kv and fake.offer.ipc is None, (token, fake.offer)
        finally:
            fake.close()
    dst = _dst(auth_token="")
    spec, tokens, seed = SideSpec(fr.GEO, 1, PageLayout(4)), 200, 8
    cache = RankCache.allocate(spec, 0, pages_needed(tokens, 4) + 2)
    pages = np.random.default_rng(seed).permutation(cache.pages)[: pages_needed(tokens, 4)]
    fill_shard(cache, seed, pages, tokens)
    src = Source(cache, Settings(**fr.SETTINGS, auth_token=""))
    try:
        src.connect([dst.address.url])  # what a tokenless destination hands out: its address with its secret
        dpages = np.random.default_rng(seed + 1).permutation(dst.cache.pages)[: pages_needed(tokens, 4)]
        hd = dst.expect("t", dpages, tokens)
        src.send("t", pages, tokens).wait(30)
        hd.wait(30)
        assert hd.path == "read" and fr.check(dst.cache, seed, dpages, tokens) == []
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("proof", ["none", "wrong"])
def test_a_source_offers_its_pages_only_to_a_destination_that_proves_the_token(proof):
    """Anyone may listen at the address a source was given: with a token, the source offers nothing
    (not even its arena) to a destination whose welcome does not prove it holds the token (an HMAC of
    the hello's nonce), and says why."""
    over = {"proof": None} if proof == "none" else {"proof": "0" * 64}
    w = OneWelcome(lambda hello: {k: v for k, v in welcome_of(fr.dst_spec(), hello, **over).items() if v is not None},
                   opened=True)
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS, auth_token=TOKEN))
    try:
        with pytest.raises(TransferFailed, match="welcome: the destination did not prove it holds KVSTAGE_AUTH_TOKEN"):
            src.connect([w.address])
        assert w.closed() and w.after == [] and src.stats().peers == 0
    finally:
        src.close()
        w.close()


def test_a_destination_with_a_token_refuses_a_stranger_and_closes():
    dst = _dst()
    try:
        s = socket.create_connection(dst.address)
        s.sendall(_frame(_hello(token="guess")))
        reply = _reply(s)
        assert reply["type"] == "error" and "auth token" in reply["reason"] and set(reply) == {"type", "reason", "about"}
        assert _closed_within(s, 2.0)
    finally:
        dst.close()


def _probe(address, token: str) -> tuple[socket.socket, dict | None]:
    s = socket.create_connection(address)
    s.sendall(_frame({"type": "probe", "version": PROTOCOL_VERSION, "token": token, "nbytes": 4096,
                      "agent": "prober", "facts": {}, "transport": "nixl"}))
    return s, _reply(s)


def test_probe_leases_need_the_token_are_limited_and_expire(monkeypatch):
    monkeypatch.setattr(dst_listener, "PROBE_LEASE_S", 1.0)
    tokenless = _dst(auth_token="")  # the default: a secret of its own, which a stranger does not hold
    try:
        s, reply = _probe(tokenless.address, "")
        assert reply == {"type": "error", "reason": AUTH_FAILED, "about": "probe"}
        assert tokenless.slots_free() == 4
        s.close()
    finally:
        tokenless.close()
    opted_out = _dst(auth_token="", allow_unauthenticated=True)  # no secret at all: it lends nothing
    try:
        s, reply = _probe(opted_out.address, "")
        assert reply["type"] == "error" and "no auth token" in reply["reason"]
        assert opted_out.slots_free() == 4
        s.close()
    finally:
        opted_out.close()
    dst = _dst()
    socks = []
    try:
        s, reply = _probe(dst.address, "guess")
        socks.append(s)
        assert reply["type"] == "error" and "auth token" in reply["reason"]
        leases = []
        for _ in range(3):
            s, reply = _probe(dst.address, TOKEN)
            socks.append(s)
            leases.append(reply)
        assert leases[0]["type"] == "probe_ok"  # a quarter of 4 slots: one lease at a time
        leased = socks[1]
        leased.sendall(_frame({"type": "probe", "version": PROTOCOL_VERSION, "token": TOKEN, "nbytes": 4096,
                               "agent": "prober", "facts": {}, "transport": "nixl"}))
        again = _reply(leased)  # a second lease on the same connection: refused, and the connection closes
        assert again["type"] == "error" and "one probe per connection" in again["reason"]
        fr.until(lambda: dst.slots_free() == 4, 3)
        s, reply = _probe(dst.address, TOKEN)  # its slot came back: the next prober gets it
        socks.append(s)
        assert reply["type"] == "probe_ok"
        assert all(r["type"] == "error" and "busy" in r["reason"] for r in leases[1:])
        assert dst.slots_free() == 3
        assert _closed_within(socks[-1], 3.0)  # the lease ends: its connection is closed
        fr.until(lambda: dst.slots_free() == 4, 3)
    finally:
        for s in socks:
            s.close()
        dst.close()


# -- 5. secure with no configuration: a secret of its own; the opt-out is one warning -------------

def test_no_token_means_a_secret_of_its_own_in_its_address_and_the_opt_out_warns_once(caplog):
    """A destination given no token makes a secret of its own (one per endpoint), on any listen address,
    and hands it out in its address (``url``); str() and repr() leave it out. With a token its address
    carries none (the sources hold the token). Only ``allow_unauthenticated`` opens it, with one WARNING."""
    cache = RankCache.allocate(fr.dst_spec(), 0, 16)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvstage"):
        a = Destination(cache, Settings(**fr.SETTINGS, auth_token=""), listen=("0.0.0.0", 0))
        b = Destination(cache, Settings(**fr.SETTINGS, auth_token=""))
    try:
        assert len(a.address.secret) >= 43 and a.address.secret != b.address.secret
        assert a.secret == a.address.secret
        assert Address.parse(a.address.url) == a.address and Address.parse(a.address.url).secret == a.secret
        assert a.secret not in str(a.address) + repr(a.address) + caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        told = [r.getMessage() for r in caplog.records if "listening on" in r.getMessage()]
        assert len(told) == 2 and all("this rank's own secret" in m for m in told), told
    finally:
        a.close()
        b.close()
    with Destination(cache, Settings(**fr.SETTINGS, auth_token=TOKEN), listen=("0.0.0.0", 0)) as d:
        assert d.address.secret == "" and d.secret == TOKEN and d.address.url == f"kvstage://0.0.0.0:{d.address[1]}"
    for listen in (("127.0.0.1", 0), ("0.0.0.0", 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvstage"):
            d = Destination(cache, Settings(**fr.SETTINGS, auth_token="", allow_unauthenticated=True), listen=listen)
            assert d.secret == "" and d.address.secret == ""
            d.close()
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warned) == 1 and "anyone who can reach" in warned[0] and "KVSTAGE_ALLOW_UNAUTHENTICATED" in warned[0]


def test_an_address_is_refused_by_rule_where_it_is_given():
    src = Source(RankCache.allocate(fr.src_spec(1), 0, 8), Settings(**fr.SETTINGS, auth_token=""))
    try:
        for bad, needle in (("http://h:1", "must be kvstage://"), ("kvstage://s@h", "must end in :PORT"),
                            (("h", 0), "port=0"), (("", 5), "host=''"), (("h", "x"), "port='x'"), (5, "address '5'")):
            with pytest.raises(ConfigError, match=re.escape(needle)):
                src.connect([bad])
        assert "s3cr" not in str(pytest.raises(ConfigError, Address.parse, "kvstage://s3cr@h").value)
    finally:
        src.close()


def _stranger(address, **over) -> dict:
    """tests/support/stranger.py in a process of its own: a raw NIXL agent and a raw socket."""
    out = subprocess.run([sys.executable, str(TESTS / "support" / "stranger.py"), json.dumps(
        {"host": address[0], "port": address[1], **over})], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "KVSTAGE_AUTH_TOKEN"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_told_nothing(got: dict, model: str = "", spec: SideSpec | None = None) -> None:
    """What a stranger got (``support.stranger``): a refusal saying only that authentication failed, for
    each try, each connection closed, and nothing of the model or of the destination's memory."""
    assert set(got["tries"]) == {"no token, its own spec", "no token, a wrong geometry", "a guessed token",
                                 "a probe", "a ping first"}, got
    for name, t in got["tries"].items():
        if name == "a ping first":  # not even an answer: the connection closes
            assert t["replies"] == [] and t["closed"], (name, t)
            continue
        assert t["replies"] == [{"type": "error", "reason": AUTH_FAILED, "about": t["about"]}], (name, t)
        assert t["closed"], (name, t)
    text = json.dumps(got)
    for word in ("metadata", "region", "welcome", "probe_ok", "slot", "layers=", "kv_heads", "float", "dtype"):
        assert word not in text, (word, text)
    if model:
        assert model not in text and model.split("#")[-1] not in text
    if spec is not None:
        assert f"layers={spec.geometry.layers}" not in text


def test_a_stranger_with_a_raw_nixl_agent_gets_nothing_from_a_default_destination():
    """The issue's attack on a default destination (no token set anywhere), from another process of this
    host that knows the port but not the secret: its hello (with its NIXL agent's metadata, its own spec or
    a wrong geometry), a guessed token, a probe and a ping first are refused, each in one message that says
    only that authentication failed; it gets no welcome, no metadata, no region and no probe slot, and is
    told nothing of the model. The destination holds no peer and every slot afterwards, and still serves
    a source that holds its address."""
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, 128), Settings(**fr.SETTINGS, auth_token=""),
                      model="/models/current#0123456789abcdef weights=fedcba9876543210")
    try:
        got = _stranger(dst.address, spec=spec_to_wire(fr.src_spec(1)))
        assert_told_nothing(got, dst.model, dst.spec)
        assert dst.stats().peers == 0 and dst.slots_free() == dst.arena.allocator.count
        _transfer(dst.address.url, dst, token="", model=dst.model)  # its real peer, byte for byte
    finally:
        dst.close()


# -- refusals are logged once, not amplified -----------------------------------------------------------

def test_repeated_refusals_are_one_line_per_address_and_cause(caplog):
    dst = _dst()
    try:
        with caplog.at_level(logging.WARNING, logger="kvstage"):
            for _ in range(30):
                s = socket.create_connection(dst.address)
                s.sendall(_frame(_hello(token="guess")))
                _closed_within(s, 2.0)
                s.close()
            s = socket.create_connection(dst.address)
            s.sendall(b"".join(_frame({"type": "ready", "req": f"r{i}", "tokens": 4}) for i in range(2000)))
            assert _closed_within(s, 2.0)
            s.close()
            for bad in (struct.pack("!I", 1 << 30), _frame(b"not json")):
                s = socket.create_connection(dst.address)
                s.sendall(bad)
                assert _closed_within(s, 2.0)
                s.close()
            time.sleep(0.2)
        lines = [r.getMessage() for r in caplog.records if "refused 127.0.0.1" in r.getMessage()]
        assert sum("auth token" in m for m in lines) == 1, lines
        assert sum("'ready' before authenticating" in m for m in lines) == 1, lines
        assert sum("exceeds the" in m for m in lines) == 1 and sum("not JSON" in m for m in lines) == 1, lines
        assert len(caplog.records) < 10, [r.getMessage() for r in caplog.records]
    finally:
        dst.close()


# -- 6. bad API input is refused where it is given ---------------------------------------------------

@pytest.mark.parametrize("pages", [[0.9, 1.7], ["0", "1"], [True, False], None, [[0, 1], [2]], [None, 1]])
def test_page_ids_that_are_not_integers_are_refused_naming_page_ids(pages):
    dst = _dst()
    try:
        with pytest.raises(ConfigError, match="page_ids"):
            dst.expect("bad", pages, 4)
    finally:
        dst.close()


@pytest.mark.parametrize("tokens", [True, 1.0, "4", 0])
def test_tokens_must_be_a_positive_int_and_not_a_bool(tokens):
    dst = _dst()
    try:
        with pytest.raises(ConfigError, match="tokens="):
            dst.expect("bad", [0, 1], tokens)
    finally:
        dst.close()


def test_a_spec_whose_tp_does_not_fit_its_heads_or_a_rank_out_of_range_is_refused_at_construction():
    with pytest.raises(IncompatibleGeometry, match="tp=3 with kv_heads=4"):
        SideSpec(KVGeometry(2, 4, 16, "bfloat16"), 3, PageLayout(4))
    with pytest.raises(ConfigError, match=r"rank=-1: must be an integer in \[0, 1\)"):
        RankCache.allocate(fr.dst_spec(), -1, 4)


# -- 7. the frozen side is named ------------------------------------------------------------------------

def test_a_source_resumed_after_a_stop_blames_itself_not_its_destination(capfd):
    """SIGSTOP the source for 3 s mid-request on the read path, past its own 1.5 s stall timeout:
    resumed, it sees no destination progress for 3 s, and used to blame its destination for it. It
    says its own process did not run instead, moves its deadlines on, and the request completes
    byte-exact."""
    big = 20_000
    dst = Destination(RankCache.allocate(fr.dst_spec(), 0, pages_needed(big, 4) + 8),
                      Settings(**(fr.SETTINGS | {"stall_timeout_s": 30.0, "peer_timeout_s": 600.0})))
    q = CTX.Queue()
    p = CTX.Process(target=fr.send_one, args=(dst.address, 0, 1, big, 4, q, {"stall_timeout_s": 1.5, "path": "read"}))
    try:
        pages = np.random.default_rng(5).permutation(dst.cache.pages)[: pages_needed(big, 4)]
        h = dst.expect("r4", pages, big)
        p.start()
        assert q.get(timeout=60)[0] == "sending"
        fr.until(lambda: h.state is State.TRANSFERRING, 30)  # its chunks are being read
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(p.pid, signal.SIGCONT)
        kind, rank, error = q.get(timeout=60)
        assert kind == "done", error
        h.wait(30)
        assert fr.check(dst.cache, 4, pages, big) == []
    finally:
        if p.pid:
            os.kill(p.pid, signal.SIGCONT)
        p.join(10)
        dst.close()
    err = capfd.readouterr().err
    assert "src 0: this process did not run for" in err and "stopped or starved" in err, err[-2000:]
