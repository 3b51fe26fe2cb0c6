"""Make SGLang 0.5.23's Python code importable on a CPU-only machine (tests only).

SGLang imports two packages that pip cannot provide for CPU here: ``triton``
(unconditionally, in ``sglang/srt/utils/common.py``) and ``torchvision`` (two
config modules, at module level; PyPI's wheel is a CUDA build). For triton we
reuse the stand-in SGLang itself ships for macOS (``sglang/_platform_stubs.py``,
loaded by file path so the ``sglang`` package is not imported first); for
torchvision an empty module is enough, since no transfer code path uses it.
Nothing of SGLang's disaggregation, KV pool or bootstrap code is replaced.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types


def install() -> None:
    if "triton" not in sys.modules and importlib.util.find_spec("triton") is None:
        _install_triton_stub()
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        # transformers decides once, at import, whether torchvision exists: let it see none
        import transformers.utils.import_utils  # noqa: F401

        tv = _NamesModule("torchvision")
        tv.transforms = _NamesModule("torchvision.transforms")
        tv.transforms.functional = _NamesModule("torchvision.transforms.functional")


class _NamesModule(types.ModuleType):
    """A module that has every name asked of it (as an empty class)."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        self.__path__ = []
        sys.modules[name] = self

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _install_triton_stub() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_platform_stubs.py")
    mspec = importlib.util.spec_from_file_location("_sglang_platform_stubs", path)
    stubs = importlib.util.module_from_spec(mspec)
    sys.modules[mspec.name] = stubs  # dataclasses in it look their module up
    mspec.loader.exec_module(stubs)
    sys.meta_path.insert(0, stubs._TritonFinder())
    triton = stubs._make_mock("triton")
    triton.__version__ = "3.0.0"
    triton.cdiv = stubs._cdiv
    triton.next_power_of_2 = stubs._next_power_of_2
    triton.Config = stubs._Config
    tl = stubs._make_mock("triton.language")

    class constexpr:
        def __init__(self, value=None):
            self.value = value

    tl.constexpr = constexpr
    triton.language = tl
    jit = stubs._make_mock("triton.runtime.jit")
    jit.JITFunction = type("JITFunction", (), {})
    jit.KernelInterface = type("KernelInterface", (stubs._StubBase,), {})
    autotuner = stubs._make_mock("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})
    autotuner.PTXASError = type("PTXASError", (Exception,), {})
    compiler = stubs._make_mock("triton.compiler")
    compiler.CompiledKernel = type("CompiledKernel", (stubs._StubBase,), {})
    impl = stubs._make_mock("triton.compiler.compiler")
    impl.ASTSource = type("ASTSource", (stubs._StubBase,), {})
    impl.triton_key = stubs._triton_key
    cache = stubs._make_mock("triton.runtime.cache")
    cache.triton_key = stubs._triton_key
    backends = stubs._make_mock("triton.backends.compiler")
    backends.GPUTarget = type("GPUTarget", (stubs._StubBase,), {})
