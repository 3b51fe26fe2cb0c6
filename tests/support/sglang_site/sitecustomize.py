"""Run at start-up by every Python process of the CPU server tests (tests only, never shipped).

tests/support/sglang_servers.py puts this folder on ``PYTHONPATH`` of the
SGLang servers it launches, so the server, its scheduler ranks (spawned) and
its detokenizer all get:

- the triton and torchvision stand-ins of ``support.sglang_cpu`` (no CPU wheel
  of either; SGLang imports both at module level);
- ``sgl_kernel`` from this folder (see sgl_kernel.py);
- with ``KVSTAGE_TEST_FAULTS`` set to a folder, the fault hook of
  ``support.sglang_faults`` (a control that must make a request fail or show
  the damage);
- with ``KVSTAGE_BENCH_WHOLE_ROOMS`` set, the prefill's ``STREAM_CHUNKS`` off
  (benchmarks/sglang_streaming.py's lever, not a setting: every chunk of a
  room leaves after the last).

Nothing is imported until the process first imports ``sglang``: the helper
processes SGLang spawns (multiprocessing's resource tracker) never pay for it.
"""

import importlib.abc
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _BeforeSglang(importlib.abc.MetaPathFinder):
    """Installs the stand-ins (and the fault hook) just before ``sglang`` is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "sglang":
            return None
        sys.meta_path.remove(self)
        if _TESTS not in sys.path:
            sys.path.append(_TESTS)
        from support import sglang_cpu

        sglang_cpu.install()
        if os.environ.get("KVSTAGE_TEST_DEBUG"):  # kvstage's DEBUG lines in the server's log
            import logging

            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[%(asctime)s %(process)d] %(name)s %(message)s"))
            kvstage = logging.getLogger("kvstage")
            kvstage.setLevel(logging.DEBUG)
            kvstage.addHandler(handler)
            kvstage.propagate = False
        if os.environ.get("KVSTAGE_TEST_FAULTS"):
            from support import sglang_faults

            sglang_faults.install(os.environ["KVSTAGE_TEST_FAULTS"])
        return None  # the regular finders import sglang itself


class _WholeRooms(importlib.abc.MetaPathFinder):
    """Turns the prefill's per-chunk streaming off as its module is first loaded."""

    NAME = "kvstage.plugin.sglang.prefill"

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.STREAM_CHUNKS = False

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _BeforeSglang())
if os.environ.get("KVSTAGE_BENCH_WHOLE_ROOMS"):
    sys.meta_path.insert(0, _WholeRooms())
