import os

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
