"""A destination rank's address as its sources are handed it: host, port and the secret.

A destination that was given no auth token makes a secret of its own
(``new_secret``), once per endpoint, and only a source that presents it is
admitted. So what a destination hands its real peers carries the secret:
``Destination.address`` is an ``Address``, a (host, port) tuple (it unpacks,
compares and hashes as one) with a ``secret`` beside it, and ``url`` its text
form, ``kvstage://SECRET@HOST:PORT``, which ``Address.parse`` reads back.
``Source.connect`` takes either, or a plain (host, port) tuple, for which it
presents its own ``auth_token``. Where the deployment set a token, every rank
holds it and an address carries no secret (the token is never handed out).

``str()`` and ``repr()`` leave the secret out: an address may be logged.
"""

from __future__ import annotations

import secrets

from kvstage.errors import ConfigError

SCHEME = "kvstage://"
#: a self-made secret's bytes of randomness (``secrets.token_urlsafe``: 43 URL-safe characters)
SECRET_BYTES = 32
#: the longest secret an address may carry (a hello's token field holds at most 4096 characters)
MAX_SECRET = 4096


def new_secret() -> str:
    """A destination's own secret, for a destination given no token."""
    return secrets.token_urlsafe(SECRET_BYTES)


class Address(tuple):
    """(host, port), and the secret a source presents to the destination there (``""``: the source's own
    ``auth_token``)."""

    _secret: str

    def __new__(cls, host: str, port: int, secret: str = ""):
        if not isinstance(host, str) or not host:
            raise ConfigError(f"address host={host!r}: must be a non-empty string")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"address port={port!r}: must be an integer in 1..65535")
        if not isinstance(secret, str) or len(secret) > MAX_SECRET or not secret.isprintable() or "@" in secret:
            raise ConfigError(f"address secret: must be printable text of at most {MAX_SECRET} characters without '@'")
        self = super().__new__(cls, (host, port))
        self._secret = secret
        return self

    @property
    def host(self) -> str:
        return self[0]

    @property
    def port(self) -> int:
        return self[1]

    @property
    def secret(self) -> str:
        return self._secret

    @property
    def url(self) -> str:
        """``kvstage://SECRET@HOST:PORT`` (``kvstage://HOST:PORT`` without a secret): what a source is handed."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}{self.secret + '@' if self.secret else ''}{host}:{self.port}"

    @classmethod
    def parse(cls, value) -> Address:
        """An ``Address``, a ``kvstage://`` URL or a (host, port) pair, as an ``Address``; anything else is
        refused naming the rule."""
        if isinstance(value, Address):
            return value
        if isinstance(value, str):
            if not value.startswith(SCHEME):
                raise ConfigError(f"address {value[:64]!r}: must be kvstage://[SECRET@]HOST:PORT or (host, port)")
            rest = value[len(SCHEME) :]
            secret, _, hostport = rest.rpartition("@")
            host, sep, port = hostport.rpartition(":")
            if not sep or not port.isdigit():
                raise ConfigError(f"address {cls._shown(value)!r}: must end in :PORT")
            if host.startswith("[") and host.endswith("]"):
                host = host[1:-1]
            return cls(host, int(port), secret)
        try:
            host, port = value
        except (TypeError, ValueError):
            raise ConfigError(
                f"address {str(value)[:64]!r}: must be kvstage://[SECRET@]HOST:PORT or (host, port)"
            ) from None
        try:
            number = int(port)
        except (TypeError, ValueError):
            raise ConfigError(f"address port={port!r}: must be an integer in 1..65535") from None
        return cls(host, number)

    @staticmethod
    def _shown(value: str) -> str:
        """A URL with its secret left out, for an error."""
        head, _, tail = value.rpartition("@")
        return f"{SCHEME}...@{tail}" if head else value[:64]

    def __reduce__(self):
        return (Address, (self.host, self.port, self.secret))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"Address({self.host!r}, {self.port}{', secret=...' if self.secret else ''})"
