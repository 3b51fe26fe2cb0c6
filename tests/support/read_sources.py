"""A reader in this process and sources in their own processes, for the read tests: each source
registers known bytes, offers what it is asked to, and can stop itself."""

from __future__ import annotations

import os
import signal
import time

import numpy as np

SOURCE_SEED = 1000  # source i holds the bytes of np.random.default_rng(SOURCE_SEED + i)


def source_bytes(i: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(SOURCE_SEED + i).integers(0, 256, nbytes, dtype=np.uint8)


def _source(name: str, conn, i: int, nbytes: int) -> None:
    """Child process: a source endpoint serving the reader's asks, progressing its transport between them."""
    import torch

    from kvstage.transports import make_transport
    from kvstage.transports.base import Spans, WriteState

    tr = make_transport(name, f"src{i}")
    data = torch.from_numpy(source_bytes(i, nbytes))
    region = tr.register(data)
    conn.send((tr.metadata(), region.to_wire()))
    reader = tr.connect(conn.recv())
    offers = []
    while True:
        if not conn.poll(0.0005):
            tr.notifications()
            continue
        cmd, *args = conn.recv()
        if cmd in ("offer", "offer and stop"):
            offsets, lengths = args
            ticket, handle = tr.offer(reader, Spans.single(region, offsets, lengths))
            offers.append(handle)
            conn.send(ticket)
            if cmd == "offer and stop":
                os.kill(os.getpid(), signal.SIGSTOP)
        elif cmd == "offers":  # every offer taken (a one-sided offer has nothing to wait for)
            deadline = time.monotonic() + 10
            pending = [h for h in offers if h is not None]
            while pending and time.monotonic() < deadline:
                pending = [h for h in pending if tr.poll(h) is not WriteState.DONE]
            conn.send(not pending)
        elif cmd == "run":  # progress for a while, as a running endpoint's loop does
            end = time.monotonic() + args[0]
            while time.monotonic() < end:
                tr.notifications()
            conn.send(True)
        elif cmd == "bye":
            break
    tr.close()


class ReadSources:
    """``n`` sources of ``peer_bytes`` each and a reader with ``dst_bytes`` of zeros (``dst``, ``region``)."""

    def __init__(self, name: str, n: int, peer_bytes: int, dst_bytes: int):
        self.name, self.n, self.peer_bytes, self.dst_bytes = name, n, peer_bytes, dst_bytes

    def __enter__(self) -> "ReadSources":
        import torch

        from kvstage.transports import make_transport
        from kvstage.transports.base import Region

        from support.procs import CTX as ctx

        self.conns, self.procs = [], []
        for i in range(self.n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_source, args=(self.name, child, i, self.peer_bytes), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.tr = make_transport(self.name, "reader")
        self.dst = torch.zeros(self.dst_bytes, dtype=torch.uint8)
        self.region = self.tr.register(self.dst)
        self.peers, self.remotes = [], []
        try:
            for conn in self.conns:
                assert conn.poll(60), "a source did not start"
                md, region = conn.recv()
                self.peers.append(self.tr.connect(md))
                self.remotes.append(Region.from_wire(region))
                conn.send(self.tr.metadata())
        except BaseException:
            self.__exit__()
            raise
        self.data = [source_bytes(i, self.peer_bytes) for i in range(self.n)]
        return self

    def __exit__(self, *exc) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                try:
                    conn.send(("bye",))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
        self.tr.close()

    def ask(self, i: int, *msg, timeout: float = 20.0):
        """Send source ``i`` an ask and wait for its answer, progressing the reader meanwhile."""
        self.conns[i].send(msg)
        deadline = time.monotonic() + timeout
        while not self.conns[i].poll(0):
            self.tr.notifications()
            assert time.monotonic() < deadline, f"source {i} did not answer {msg[0]!r}"
        return self.conns[i].recv()

    def offer(self, i: int, remote, lengths, then_stop: bool = False) -> bytes:
        return self.ask(i, "offer and stop" if then_stop else "offer", list(map(int, remote)), list(map(int, lengths)))

    def read(self, i: int, local, remote, lengths):
        """Source ``i`` offers ``remote``; the reader reads it into ``local``: the read's handle."""
        from kvstage.transports.base import Spans

        ticket = self.offer(i, remote, lengths)
        return self.tr.read(self.peers[i], Spans.single(self.region, local, lengths),
                            Spans.single(self.remotes[i], remote, lengths), ticket)

    def warm_up(self, i: int) -> None:
        """One small read from source ``i`` while both run."""
        h = self.read(i, [0], [0], [64])
        finish(self.tr, [h])
        self.tr.release(h)

    def state(self, i: int) -> str:
        with open(f"/proc/{self.procs[i].pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def wait_stopped(self, i: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.state(i) != "T":
            assert time.monotonic() < deadline, f"source {i} did not stop"
            time.sleep(0.001)

    def clear(self) -> None:
        self.dst.zero_()

    def expected(self, plans) -> np.ndarray:
        """The reader's buffer after reads ``(source, local, remote, lengths)`` into a zeroed one."""
        want = np.zeros(self.dst_bytes, dtype=np.uint8)
        for i, local, remote, lengths in plans:
            for lo, ro, n in zip(local, remote, lengths):
                want[lo : lo + n] = self.data[i][ro : ro + n]
        return want


def random_spans(rng, n: int, remote_bytes: int, local_bytes: int):
    """``n`` disjoint spans of random lengths (about half of the smaller side in all) at random places on
    each side, paired in another order."""
    lengths = rng.integers(1, max(2, min(remote_bytes, local_bytes) // n), n)

    def places(size):
        gaps = rng.multinomial(size - int(lengths.sum()) - n, np.ones(n + 1) / (n + 1))[:n] + 1
        order = rng.permutation(n)
        starts = np.cumsum(gaps + lengths[order]) - lengths[order]
        out = np.empty(n, dtype=np.int64)
        out[order] = starts
        return out

    return places(local_bytes), places(remote_bytes), lengths.astype(np.int64)


def finish(tr, handles, timeout: float = 20.0) -> float:
    """Poll ``handles`` until every one is done (TransportError passes through); the seconds it took."""
    from kvstage.transports.base import WriteState

    t0 = time.monotonic()
    pending = list(handles)
    while pending:
        pending = [h for h in pending if tr.poll(h) is not WriteState.DONE]
        assert time.monotonic() - t0 < timeout, f"{len(pending)} of {len(handles)} transfers not done after {timeout} s"
    return time.monotonic() - t0
