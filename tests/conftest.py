import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
# every endpoint authenticates, as the bench's do: a test of a tokenless endpoint says auth_token=""
os.environ.setdefault("KVSTAGE_AUTH_TOKEN", "kvstage-tests")

import pytest  # noqa: E402


def _ucx_missing() -> str | None:
    """Why the ucx transport cannot run here, or None."""
    import importlib.util

    # found, not imported: importing ucxx sets UCX_* variables in os.environ, which every
    # child process a test starts would then inherit
    if importlib.util.find_spec("ucxx") is None:
        return "ucxx is not installed; pip install 'kvstage[ucx]'"
    return None


@pytest.fixture(autouse=True)
def _needs_ucx(request):
    """A test marked ``ucx`` (it runs the ucx transport: tests/support/marks.py) skips, with the
    reason, where UCXX is absent; ``KVSTAGE_REQUIRE_UCX=1`` (the CI and the GPU run) turns that skip
    into a failure. Unmarked tests run everywhere, whatever their names say."""
    if request.node.get_closest_marker("ucx") is None:
        return
    why = _ucx_missing()
    if why is None:
        return
    if os.environ.get("KVSTAGE_REQUIRE_UCX"):
        pytest.fail(f"KVSTAGE_REQUIRE_UCX is set but {why}")
    pytest.skip(why)


@pytest.fixture(params=["native", "torch"])
def host_copy(request, monkeypatch):
    """Run a test's host gathers and scatters both ways: the native span copies and torch/numpy.
    Every cache the test allocates (``RankCache.allocate``) is given that copier."""
    from kvstage.staging import hostcopy
    from kvstage.staging.cache import RankCache

    if request.param == "native":
        assert hostcopy.available(), hostcopy.why_unavailable()
    allocate = RankCache.allocate.__func__

    def with_copier(cls, *args, copier=None, **kw):
        return allocate(cls, *args, copier=copier or request.param, **kw)

    monkeypatch.setattr(RankCache, "allocate", classmethod(with_copier))
    return request.param


@pytest.fixture(scope="session", autouse=True)
def _one_bench_launcher():
    """The bench runs in this process (``runner.run``: test_transfer.py, test_bench_run.py) share one
    warm launcher for the session instead of starting one each: every rank is still a process
    forked afresh from it (kvstage/bench/launcher.py), in the test's environment. A ``kvstage bench``
    a test starts has its own. PYTEST_CURRENT_TEST changes with every test and is read by no rank."""
    from kvstage.bench.children import keep_launcher

    with keep_launcher(ignore_env=("PYTEST_CURRENT_TEST",)):
        yield
