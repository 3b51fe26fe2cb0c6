"""How an endpoint's loop waits on its control sockets: select(2), which waits in microseconds but
sees no descriptor past 1023, and epoll past that; a short busy poll instead of a sleep while a
transfer is near; and a thread timer slack tight enough for those waits. Apart from the loop's
events and state, which ``endpoint`` holds."""

from __future__ import annotations

import ctypes
import logging
import select
import selectors
import socket
import time

log = logging.getLogger("kvstage")

SELECT_LIMIT = 1024  # select(2) sees no descriptor from here on (FD_SETSIZE)
PR_SET_TIMERSLACK = 29


def tight_timer() -> None:
    """Linux lets a sleep overshoot by the thread's timer slack, 50 us by default:
    more than the loop's poll interval on a GPU host. 1 us for the calling thread."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: its sleeps keep their own precision
        pass


class SocketWait:
    """The sockets one loop reads (``watched``: socket -> its connection, None for the wake-up
    socket) and its wait on them. ``name`` names the loop in logs; ``busy_wait`` is its poll step."""

    def __init__(self, name: str, busy_wait: float):
        self.name, self.busy_wait = name, busy_wait
        self.selector: selectors.BaseSelector | None = None
        self.wake, self.waker = socket.socketpair()  # a byte on waker: the loop's queue holds an event
        for s in (self.wake, self.waker):
            s.setblocking(False)
        self.watched: dict = {self.wake: None}
        self.socks, self.low = [self.wake], True
        self.changed()

    def poll(self, until: float) -> list:
        """The readable sockets, polled every ``busy_wait`` until one is readable or
        ``until`` passes. Short waits keep the thread warm and wake it fast, and leave
        the GIL (an engine's own Python thread) and the state lock free between polls."""
        while True:
            left = until - time.perf_counter()
            ready = self.ready(min(self.busy_wait, max(left, 0.0)))
            if ready or left <= 0:
                return ready

    def ready(self, timeout: float) -> list:
        """The watched sockets readable within ``timeout`` s. select(2) waits in
        microseconds (the loop polls the transport every 20-200 µs while a transfer
        is near) but sees no descriptor past 1023; past that (a process with many
        files open), epoll, which waits in milliseconds: a shorter wait is then a
        sleep before the check, and a message waits for its end."""
        if self.low:
            return select.select(self.socks, [], [], timeout)[0]
        if 0 < timeout < 1e-3:
            time.sleep(timeout)
            timeout = 0
        assert self.selector is not None  # made by changed whenever _low is False
        return [key.fileobj for key, _ in self.selector.select(timeout)]

    def changed(self) -> None:
        """The wait's view of ``watched``: select(2)'s list, and past its reach an epoll set."""
        self.socks = list(self.watched)
        low = all(sock.fileno() < SELECT_LIMIT for sock in self.socks)
        if low != self.low:
            log.info(
                "%s: control sockets %s descriptor %d: the loop waits with %s",
                self.name,
                "below" if low else "past",
                SELECT_LIMIT - 1,
                "select(2) again" if low else "epoll (millisecond timeouts: shorter waits become sleeps)",
            )
        self.low = low
        if self.selector is not None:
            self.selector.close()
            self.selector = None
        if not low:
            self.selector = selectors.DefaultSelector()
            for sock in self.socks:
                if sock.fileno() >= 0:  # one closed by this side is swept before the next wait
                    self.selector.register(sock, selectors.EVENT_READ)

    def close(self) -> None:
        if self.selector is not None:
            self.selector.close()
        self.wake.close()
        self.waker.close()
