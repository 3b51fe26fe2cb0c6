"""Builds kvstage's two native pieces: the host span copier (kvstage/staging/_spans.c)
and the control connections' pinger (kvstage/protocol/_beat.c).

Each is a plain C library that kvstage loads with ctypes (no Python API, so no
Python headers are needed). optional=True: without a C compiler the install
still succeeds; host copies stay on numpy/torch and pings come from each
endpoint's loop thread, and each endpoint says so in its log (`kvstage bench
--copier native` refuses to start instead).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvstage.staging._spans", ["kvstage/staging/_spans.c"], extra_compile_args=["-O3"], optional=True),
    Extension("kvstage.protocol._beat", ["kvstage/protocol/_beat.c"], extra_compile_args=["-O2", "-pthread"],
              extra_link_args=["-pthread"], optional=True),
])
