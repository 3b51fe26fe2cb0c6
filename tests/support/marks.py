"""What a test case needs, said with markers rather than found in its name.

A case over the ``ucx`` transport needs UCXX: it carries ``pytest.mark.ucx``, and
``tests/conftest.py`` skips it, naming the reason, where UCXX is not installed
(``KVSTAGE_REQUIRE_UCX=1`` turns that skip into a failure). The markers are
registered in pyproject.toml; ``pytest -m ucx`` selects the UCX cases, ``-m 'not ucx'``
leaves them out. A test of the ucx transport that is not parametrized over
transports says ``@pytest.mark.ucx`` itself; a pure test that only mentions UCX
(a parser, a setting, a rule) carries no marker and runs everywhere."""

from __future__ import annotations

import pytest

#: every transport a test may run over
TRANSPORTS = ("nixl", "ucx", "cma")
#: what a transport needs beyond the test extra's NIXL: a marker each
_NEEDS = {"ucx": pytest.mark.ucx}


def needs(*transports: str) -> tuple:
    """The marks of a case over ``transports`` (one or several)."""
    return tuple(_NEEDS[t] for t in dict.fromkeys(transports) if t in _NEEDS)


def over(transport: str, *values, id: str | None = None, marks=()) -> object:
    """``pytest.param(transport, *values)`` carrying what ``transport`` needs (and ``marks``)."""
    return pytest.param(transport, *values, id=id, marks=(*needs(transport), *marks))
