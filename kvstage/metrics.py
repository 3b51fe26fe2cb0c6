"""kvstage's Prometheus metrics: one set per process, a labelled share of it per endpoint.

An endpoint asks ``endpoint_metrics(role, rank, engine)`` for its ``EndpointMetrics``
and reports events to it: a request finished, a failure (its stage and a cause class),
a stage's seconds, the free slots, the requests in flight, the judgement of a peer's
link. Every method is a few dictionary lookups and counter increments: the label
children are bound once per endpoint and peer, and kept. docs/metrics.md lists every
metric, its labels, where it shows up, and the alerts to set.

``prometheus_client`` is optional (``pip install 'kvstage[metrics]'``) and imported
only when the first endpoint asks for its metrics, never when this module is
imported: SGLang and vLLM choose prometheus_client's multiprocess mode by setting
``PROMETHEUS_MULTIPROC_DIR`` before they import it, and a plugin loaded earlier must
not decide it for them. Without prometheus_client, or with ``KVSTAGE_METRICS=off``,
``endpoint_metrics`` returns an object that does nothing, and the first endpoint of
the process says so in one INFO line.

In multiprocess mode every process writes its values into the shared directory and
the engine's ``/metrics`` sums them; gauges sum over live processes (``livesum``) and
a link's judgement is the largest over them (``livemax``). A series cannot be removed
there: a closed endpoint's gauges and a replaced link judgement are set to 0 instead.

Imports nothing from kvstage but ``errors``: it sits in the lowest layer, beside
``config``, so that every layer may report to it.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import re
import threading
import time

from kvstage.errors import ConfigError

log = logging.getLogger("kvstage")

#: how a missing prometheus_client is installed, in every message that needs it
INSTALL = "pip install 'kvstage[metrics]'"
#: the process-wide switch, read once: "off" exports nothing (an operator's choice, e.g. in an engine that has
#: prometheus_client installed for itself); "on" or unset exports when prometheus_client is importable
SWITCH = "KVSTAGE_METRICS"

#: the cause classes of ``kvstage_failures_total`` (``classify``); a small, closed set
CAUSES = (
    "connection_lost",
    "peer_silent",
    "timeout",
    "aborted",
    "refused",
    "read_error",
    "copy_error",
    "mismatch",
    "corrupt",
    "shutdown",
    "other",
)
#: the stages a failure or a slow request is labelled with; any other is "other"
FAILURE_STAGES = (
    "start",
    "route",
    "waiting_for_a_reader",
    "waiting_for_writers",
    "ready",
    "read",
    "gather",
    "scatter",
    "checksum",
    "abort",
    "shutdown",
    "other",
)
#: the stages ``kvstage_stage_seconds`` times, per chunk
STAGES = ("gather", "read", "scatter", "slot_wait")
SEVERITIES = ("INFO", "WARNING", "ERROR")
#: distinct peer labels one process gives; later peers are labelled "other" (said once, at INFO)
MAX_PEER_LABELS = 256

#: kvstage_request_seconds: announce to done, 0.5 ms (one H200, small) to 30 s (a loaded host, large)
REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: kvstage_stage_seconds: one chunk's gather, read or scatter, or its wait for a slot
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)

_ENDPOINT = ("role", "rank", "engine")


# -- cause classes -------------------------------------------------------------------------------

_ABORTED_BY_PEER = re.compile(r"^(source|destination) aborted:")
_TIMEOUT = re.compile(r"\b(within|after|for) [0-9.]+ ?s\b|did not complete")
_RULES = (  # (class, pattern), first match wins; the texts are the protocol's and the engine plugins' causes
    ("connection_lost", re.compile(r"connection lost|not connected|cannot connect|every rank of .* left")),
    ("peer_silent", re.compile(r"no control message for")),
    ("mismatch", re.compile(r"tokens?,? .*(expects|sends)|they must agree")),
    ("shutdown", re.compile(r"^(source|destination) closed$")),
    ("timeout", _TIMEOUT),
    (
        "aborted",
        re.compile(r"aborted by caller|request was aborted|aborted the request|finished while its kv was loading"),
    ),
    ("refused", re.compile(r"no allowed path|taken by engine|past the .* pages|lie outside|is not allowed here")),
    # a rank that only echoes another rank's failure (SGLang's poll all-reduce): the cause is that rank's, counted there
    ("other", re.compile(r"(on|from) another (prefill |decode )?rank")),
)
_BY_STAGE = {
    "abort": "aborted",
    "read": "read_error",
    "gather": "copy_error",
    "scatter": "copy_error",
    "checksum": "corrupt",
    "shutdown": "shutdown",
    "start": "mismatch",
    "route": "refused",
    "ready": "refused",
}


def classify(cause: str, stage: str = "") -> str:
    """The class of a failure's cause text, one of ``CAUSES``. A peer's abort is
    ``aborted`` whatever its reason (the peer counts its own cause); a text no rule
    knows takes its class from the stage where it has one (a transport's error at
    ``read`` is a ``read_error``, a copy's error at ``gather`` or ``scatter`` a
    ``copy_error``, an engine plugin's load that could not start, its peer's layout
    or parameters not fitting, a ``mismatch``), else ``other``."""
    text = str(cause).strip().lower()
    if _ABORTED_BY_PEER.match(text):
        return "aborted"
    if text.startswith("refused"):
        return "refused"
    for name, pattern in _RULES:
        if pattern.search(text):
            return name
    return _BY_STAGE.get(stage_label(stage), "other")


def stage_label(stage: str) -> str:
    """A failure's stage as a label: ``waiting for grant`` -> ``waiting_for_grant``; unknown ones are ``other``
    (a peer's refusal names the message it refused: not a label to take as it comes)."""
    s = str(stage).strip().lower().replace(" ", "_")
    return s if s in FAILURE_STAGES else "other"


# -- the process's switch and families -------------------------------------------------------------

_lock = threading.RLock()
_state: dict = {}  # "decision": (on, why); "families": _Families; "served": (host, port)


def _decision() -> tuple[bool, str]:
    """Whether this process exports metrics, and why not; decided once."""
    got = _state.get("decision")
    if got is None:
        raw = os.environ.get(SWITCH, "").strip()
        low = raw.lower()
        if low in ("off", "0", "false", "no"):
            got = (False, f"{SWITCH}={raw}")
        elif low not in ("", "on", "1", "true", "yes"):
            raise ConfigError(f"{SWITCH}={raw!r}: must be on or off")
        elif importlib.util.find_spec("prometheus_client") is None:
            got = (False, f"prometheus_client is not installed ({INSTALL})")
        else:
            got = (True, "")
        _state["decision"] = got
    return got


def available() -> bool:
    """Whether this process exports kvstage's metrics (prometheus_client importable, not switched off)."""
    return _decision()[0]


def why_unavailable() -> str:
    """Why this process exports no metrics ("" when it does)."""
    return _decision()[1]


class _Families:
    """The metric families of this process, registered once in prometheus_client's default
    registry (an engine's ``/metrics`` serves that, or its multiprocess directory) and in
    a registry of their own (``exposition``, ``serve``)."""

    def __init__(self):
        from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, values

        self.multiprocess = bool(getattr(values.ValueClass, "_multiprocess", False))
        ep = _ENDPOINT
        self.requests = Counter(
            "kvstage_requests", "Requests finished, by result (done or failed).", ep + ("peer", "result"), registry=None
        )
        self.failures = Counter(
            "kvstage_failures",
            "Failed requests, by the stage and the class of the cause.",
            ep + ("peer", "stage", "cause"),
            registry=None,
        )
        self.slow = Counter(
            "kvstage_slow_requests",
            "Requests that waited long on a peer that is alive (busy, not dead), by stage.",
            ep + ("peer", "stage"),
            registry=None,
        )
        self.bytes = Counter(
            "kvstage_transfer_bytes",
            "KV bytes moved (read into a destination, made readable by a source), failed requests' included.",
            ep + ("peer",),
            registry=None,
        )
        self.seconds = Histogram(
            "kvstage_request_seconds",
            "Done requests: seconds from announce to done.",
            ep + ("peer",),
            buckets=REQUEST_BUCKETS,
            registry=None,
        )
        self.stages = Histogram(
            "kvstage_stage_seconds",
            "Seconds per chunk in each stage (gather, read, scatter, slot_wait).",
            ep + ("stage",),
            buckets=STAGE_BUCKETS,
            registry=None,
        )
        self.slots_free = Gauge(
            "kvstage_slots_free", "Staging slots free now.", ep, registry=None, multiprocess_mode="livesum"
        )
        self.slots_total = Gauge(
            "kvstage_slots_total", "Staging slots in the arena.", ep, registry=None, multiprocess_mode="livesum"
        )
        self.in_flight = Gauge(
            "kvstage_requests_in_flight", "Requests in flight now.", ep, registry=None, multiprocess_mode="livesum"
        )
        self.links = Gauge(
            "kvstage_link_info",
            "The connect-time judgement of each peer's link: 1 for its current path and severity.",
            ep + ("peer", "path", "severity"),
            registry=None,
            multiprocess_mode="livemax",
        )
        self.checksum_failures = Counter(
            "kvstage_checksum_failures",
            "Chunks whose bytes landed with another checksum than the source's (each fails its request).",
            ep + ("peer",),
            registry=None,
        )
        self.recomputes = Counter(
            "kvstage_recomputes",
            "Engine requests whose KV load failed and that the engine recomputes instead.",
            ("engine",),
            registry=None,
        )
        self.all = (
            self.requests,
            self.failures,
            self.slow,
            self.bytes,
            self.seconds,
            self.stages,
            self.slots_free,
            self.slots_total,
            self.in_flight,
            self.links,
            self.checksum_failures,
            self.recomputes,
        )
        self.registry = CollectorRegistry(auto_describe=True)
        clash = []
        for family in self.all:
            self.registry.register(family)
            try:
                REGISTRY.register(family)
            except ValueError:  # another copy of kvstage registered these names in this process
                clash.append(family._name)
        if clash:
            log.warning(
                "kvstage metrics: prometheus_client's default registry already holds %s; this copy of "
                "kvstage exports them through metrics_port only",
                ", ".join(clash),
            )
        self.groups: dict = {}  # (role, rank, engine) -> _Group
        self.peers: set = set()  # peer labels given out (``MAX_PEER_LABELS``)
        self.capped = False
        if self.multiprocess:
            atexit.register(_mark_dead)

    def peer_label(self, peer: str) -> str:
        peer = str(peer)
        with _lock:
            if peer in self.peers:
                return peer
            if len(self.peers) < MAX_PEER_LABELS:
                self.peers.add(peer)
                return peer
            if not self.capped:
                self.capped = True
                log.info(
                    'kvstage metrics: more than %d peers seen in this process; later peers are labelled peer="other"',
                    MAX_PEER_LABELS,
                )
        return "other"

    def group(self, labels: tuple) -> _Group:
        with _lock:
            g = self.groups.get(labels)
            if g is None:
                g = self.groups[labels] = _Group(self, labels)
            return g


def _mark_dead() -> None:
    """At a clean exit in multiprocess mode: this process's live gauges leave the directory."""
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())
    except Exception:  # the directory is gone already: nothing to leave
        pass


def _families() -> _Families | None:
    """This process's families, made on first use; None when metrics are off (logged once)."""
    fam = _state.get("families")
    if fam is not None or _state.get("announced"):
        return fam
    with _lock:
        if _state.get("announced"):
            return _state.get("families")
        on, why = _decision()
        if on:
            fam = _state["families"] = _Families()
            multiproc = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            if multiproc and not fam.multiprocess:
                log.warning(
                    "kvstage metrics: PROMETHEUS_MULTIPROC_DIR is set but prometheus_client was imported "
                    "before it was: this process's metrics stay in its memory (metrics_port), not in the "
                    "directory the engine's /metrics reads"
                )
            log.info(
                "kvstage metrics: on (prometheus_client; %s)",
                f"multiprocess directory {multiproc}" if fam.multiprocess else "this process's default registry",
            )
        else:
            log.info("kvstage metrics: off: %s; no kvstage_* metrics from this process", why)
        _state["announced"] = True
        return fam


# -- one endpoint's share ----------------------------------------------------------------------------


class _Group:
    """The gauges of one (role, rank, engine): several endpoints of a process may share it (an
    engine plugin keeps one per peer engine), so its gauges are the sums over its live endpoints."""

    def __init__(self, fam: _Families, labels: tuple):
        self.fam, self.labels = fam, labels
        self.lock = threading.Lock()
        self.values: dict = {}  # member -> [slots free, slots total, in flight]
        self.families = (fam.slots_free, fam.slots_total, fam.in_flight)
        self.children: tuple | None = None  # their children for these labels, made on the first set
        self.links: dict = {}  # (peer label, path, severity) -> how many members hold it

    def set(self, member, index: int, value: int) -> None:
        with self.lock:
            row = self.values.setdefault(member, [0, 0, 0])
            row[index] = value
            if self.children is None:
                self.children = tuple(f.labels(*self.labels) for f in self.families)
            self.children[index].set(sum(r[index] for r in self.values.values()))

    def leave(self, member) -> None:
        with self.lock:
            if self.values.pop(member, None) is None or self.children is None:
                return
            if self.values or self.fam.multiprocess:  # the directory keeps every series it saw: 0 is "none"
                for i, child in enumerate(self.children):
                    child.set(sum(r[i] for r in self.values.values()))
                return
            for family in self.families:
                family.remove(*self.labels)
            self.children = None

    def hold_link(self, key: tuple) -> None:
        with self.lock:
            n = self.links.get(key, 0)
            self.links[key] = n + 1
            if not n:
                self.fam.links.labels(*self.labels, *key).set(1)

    def drop_link(self, key: tuple) -> None:
        with self.lock:
            n = self.links.get(key, 0) - 1
            if n > 0:
                self.links[key] = n
                return
            self.links.pop(key, None)
            if self.fam.multiprocess:  # the directory keeps every series it saw: 0 is "no longer"
                self.fam.links.labels(*self.labels, *key).set(0)
            else:
                self.fam.links.remove(*self.labels, *key)


class _Peer:
    __slots__ = ("done", "failed", "bytes", "seconds")

    def __init__(self, fam: _Families, labels: tuple):
        self.done = fam.requests.labels(*labels, "done")
        self.failed = fam.requests.labels(*labels, "failed")
        self.bytes = fam.bytes.labels(*labels)
        self.seconds = fam.seconds.labels(*labels)


class EndpointMetrics:
    """One endpoint's metrics: the labels role, rank, engine (this endpoint's engine id, "" by default) are fixed.

    ``peer`` is an "engine/rank" string the caller gives; a process gives at most
    ``MAX_PEER_LABELS`` distinct ones. Counters and histograms stay after ``close``
    (they only ever grow); gauges and link judgements go."""

    def __init__(self, fam: _Families, role: str, rank: int, engine: str = ""):
        self._fam = fam
        self._labels = (str(role), str(rank), str(engine))
        self._group = fam.group(self._labels)
        self._peers: dict = {}  # peer -> _Peer
        self._stages: dict = {}  # stage -> histogram child
        self._counted: dict = {}  # (peer, stage, cause) or (peer, stage) -> counter child
        self._slots: tuple[int, int] | None = None  # last values given: a repeat sets nothing
        self._flight: int | None = None
        self._links: dict = {}  # (peer, kv) -> (peer label, path, severity)
        self._closed = False

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            if len(self._peers) >= 4 * MAX_PEER_LABELS:
                self._peers.clear()
            p = self._peers[peer] = _Peer(self._fam, self._labels + (self._fam.peer_label(peer),))
        return p

    def request_finished(self, peer: str, ok: bool, seconds: float, nbytes: int) -> None:
        """A request reached DONE (``ok``) or FAILED on this endpoint: ``requests_total{result}``, its bytes
        moved (``transfer_bytes_total``), and for a done one its seconds from announce to done
        (``request_seconds``)."""
        p = self._peers.get(peer) or self._peer(peer)
        if ok:
            p.done.inc()
            p.seconds.observe(seconds)
        else:
            p.failed.inc()
        if nbytes:
            p.bytes.inc(nbytes)

    def failure(self, peer: str, stage: str, cause: str) -> None:
        """A request failed at ``stage`` with ``peer``: ``failures_total{stage, cause=classify(cause)}``."""
        st = stage_label(stage)
        key = (peer, st, classify(cause, st))
        child = self._counted.get(key)
        if child is None:
            if len(self._counted) >= 4 * MAX_PEER_LABELS:
                self._counted.clear()
            child = self._counted[key] = self._fam.failures.labels(*self._labels, self._fam.peer_label(peer), *key[1:])
        child.inc()

    def checksum_failure(self, peer: str) -> None:
        """A chunk from ``peer`` landed with another checksum than its source's: ``checksum_failures_total``."""
        self._fam.checksum_failures.labels(*self._labels, self._fam.peer_label(peer)).inc()

    def slow(self, peer: str, stage: str) -> None:
        """A request waited long at ``stage`` on a peer that is alive: ``slow_requests_total{stage}``."""
        key = (peer, stage_label(stage))
        child = self._counted.get(key)
        if child is None:
            if len(self._counted) >= 4 * MAX_PEER_LABELS:
                self._counted.clear()
            child = self._counted[key] = self._fam.slow.labels(*self._labels, self._fam.peer_label(peer), key[1])
        child.inc()

    def stage(self, stage: str, seconds: float) -> None:
        """One chunk's ``seconds`` in ``stage`` (gather, read, scatter, slot_wait): ``stage_seconds{stage}``."""
        child = self._stages.get(stage)
        if child is None:
            if stage not in STAGES:
                raise ValueError(f"stage={stage!r}: must be one of {', '.join(STAGES)}")
            child = self._stages[stage] = self._fam.stages.labels(*self._labels, stage)
        child.observe(seconds)

    def slots(self, free: int, total: int) -> None:
        """The arena's free and total slots now (``slots_free``, ``slots_total``)."""
        if self._closed or self._slots == (free, total):
            return
        old = self._slots
        self._slots = (free, total)
        if old is None or old[0] != free:
            self._group.set(self, 0, free)
        if old is None or old[1] != total:
            self._group.set(self, 1, total)

    def in_flight(self, n: int) -> None:
        """Requests in flight on this endpoint now (``requests_in_flight``)."""
        if self._closed or self._flight == n:
            return
        self._flight = n
        self._group.set(self, 2, n)

    def link(self, peer: str, path: str, severity, kv: bool = False) -> None:
        """The connect-time judgement of ``peer``'s link: ``link_info{peer, path, severity} = 1``, replacing
        that peer's earlier judgement (of the arenas, or with ``kv`` of the KV pages the direct path writes)."""
        sev = str(getattr(severity, "value", severity)).upper()
        if sev not in SEVERITIES:
            raise ValueError(f"severity={severity!r}: must be one of {', '.join(SEVERITIES)}")
        if self._closed:
            return
        key = (self._fam.peer_label(peer), str(path), sev)
        old = self._links.get((peer, kv))
        if old == key:
            return
        self._links[(peer, kv)] = key
        self._group.hold_link(key)
        if old is not None:
            self._group.drop_link(old)

    def close(self) -> None:
        """Drop this endpoint's gauges and link judgements, so that a closed endpoint does not linger."""
        if self._closed:
            return
        self._closed = True
        for key in self._links.values():
            self._group.drop_link(key)
        self._links.clear()
        self._group.leave(self)


class _NoMetrics:
    """What ``endpoint_metrics`` returns when this process exports no metrics: every call does nothing."""

    __slots__ = ()

    def request_finished(self, peer, ok, seconds, nbytes) -> None:
        pass

    def failure(self, peer, stage, cause) -> None:
        pass

    def slow(self, peer, stage) -> None:
        pass

    def checksum_failure(self, peer) -> None:
        pass

    def stage(self, stage, seconds) -> None:
        pass

    def slots(self, free, total) -> None:
        pass

    def in_flight(self, n) -> None:
        pass

    def link(self, peer, path, severity, kv=False) -> None:
        pass

    def close(self) -> None:
        pass


_OFF = _NoMetrics()


def endpoint_metrics(role: str, rank: int, engine: str = "") -> EndpointMetrics | _NoMetrics:
    """The metrics of one endpoint (``role`` src or dst, its ``rank``, its ``engine`` id), or an
    object that does nothing when this process exports none (said once, at INFO)."""
    fam = _families()
    return _OFF if fam is None else EndpointMetrics(fam, role, rank, engine)


def recomputed(engine: str) -> None:
    """An engine plugin: a request's KV load failed and the engine recomputes it (``kvstage_recomputes_total``)."""
    fam = _families()
    if fam is not None:
        fam.recomputes.labels(str(engine)).inc()


def exposition() -> bytes:
    """This process's kvstage metrics as Prometheus text (b"" when it exports none)."""
    fam = _families()
    if fam is None:
        return b""
    from prometheus_client import generate_latest

    return generate_latest(fam.registry)


# -- the standalone endpoint -----------------------------------------------------------------------------


def serve(port: int, host: str = "127.0.0.1") -> tuple[str, int]:
    """Serve this process's kvstage metrics over HTTP on ``host:port`` (``/metrics``), once per
    process: a second call for the same address (or port 0) returns it; one for another raises."""
    fam = _families()
    if fam is None:
        raise ConfigError(f"metrics_port={port}: this process exports no metrics: {why_unavailable()}")
    with _lock:
        served = _state.get("served")
        if served is not None:
            if port in (0, served[1]) and host == served[0]:
                return served
            raise ConfigError(
                f"metrics_port={port}: this process serves its metrics on {served[0]}:{served[1]} "
                f"already; one process serves them on one address (give every endpoint of a process "
                "the same metrics_port)"
            )
        from prometheus_client import start_http_server

        try:
            server, _thread = start_http_server(port, addr=host, registry=fam.registry)
        except OSError as e:
            raise ConfigError(f"metrics_port={port}: cannot listen on {host}:{port}: {e}") from None
        served = _state["served"] = (host, server.server_address[1])
    log.info("kvstage metrics: serving http://%s:%d/metrics", *served)
    return served


def start_from_settings(settings, rank: int = 0, host: str = "127.0.0.1") -> tuple[str, int] | None:
    """What an endpoint calls at construction: with ``settings.metrics_port`` set, serve this
    process's metrics on ``metrics_port + rank`` (ranks of one host each have a port); the
    first endpoint's call starts the server, later ones find it."""
    port = getattr(settings, "metrics_port", None)
    _families()  # the process's one line about its metrics, on or off
    if port is None:
        return None
    if not available():
        raise ConfigError(f"metrics_port={port}: {why_unavailable()}; unset metrics_port or export metrics")
    if port + rank > 65535:
        raise ConfigError(f"metrics_port={port}: rank {rank} serves on metrics_port + rank = {port + rank}, past 65535")
    with _lock:
        served = _state.get("served")
        if served is not None and served[0] == host:
            return served  # this process serves already (its first endpoint's rank gave the port)
        return serve(port + rank, host)


# -- an engine plugin's summary line -------------------------------------------------------------------------


class LoadSummary:
    """The rate-limited INFO summary of an engine plugin's KV loads: ``add`` each finished load,
    and ``due`` gives the line to log at most once per ``interval_s`` (None between, and when
    nothing was loaded). Pure: the clock is given."""

    def __init__(self, what: str, interval_s: float = 60.0, clock=time.monotonic):
        self.what, self.interval_s, self.clock = what, interval_s, clock
        self.since = clock()
        self._reset()

    def _reset(self) -> None:
        self.done, self.failed, self.bytes = 0, 0, 0
        self.seconds: list[float] = []

    def add(self, ok: bool, seconds: float, nbytes: int) -> None:
        if ok:
            self.done += 1
            self.seconds.append(seconds)
        else:
            self.failed += 1
        self.bytes += nbytes

    def due(self) -> str | None:
        now = self.clock()
        elapsed = now - self.since
        if elapsed < self.interval_s or not (self.done or self.failed):
            return None
        line = (
            f"{self.what}: {self.done + self.failed} KV loads in the last {elapsed:.0f} s: {self.done} done, "
            f"{self.failed} failed, {self.bytes / 1e6:.1f} MB"
        )
        if self.seconds:
            s = sorted(self.seconds)
            line += f", p50 {s[(len(s) - 1) // 2] * 1e3:.1f} ms, max {s[-1] * 1e3:.1f} ms"
        self.since = now
        self._reset()
        return line
