"""Imported last by the tests' forkserver (``support.procs.PRELOAD``) and nowhere else: what its
children inherit is never collected again, so a child's full collection (a transport's close runs
one) takes microseconds, not 0.1 s, and copies none of those pages (gc.freeze's purpose, before a fork)."""

import gc

gc.freeze()
