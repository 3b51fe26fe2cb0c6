import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import pytest  # noqa: E402


@pytest.fixture(params=["native", "numpy"])
def host_copy(request, monkeypatch):
    """Run a test's host gathers and scatters both ways (``Settings.host_copy``): the native
    span copies and numpy/torch. Sets the choice an endpoint would make for every cache."""
    from kvstage.staging import hostcopy
    from kvstage.staging.cache import RankCache

    if request.param == "native":
        assert hostcopy.available(), hostcopy.why_unavailable()
    monkeypatch.setattr(RankCache, "_spans", request.param == "native", raising=False)
    return request.param
