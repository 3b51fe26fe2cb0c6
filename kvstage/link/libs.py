"""The software on the path: NIXL's plugins, the UCX it bundles, UCX's modules."""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess

from kvstage.link.finding import fact

_NIXL_PACKAGES = ("nixl_cu13", "nixl_cu12")


def nixl_libs_dir() -> tuple[str | None, str | None]:
    """(package name, its bundled-libraries folder) of the first NIXL build installed."""
    for name in _NIXL_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg_dir = list(spec.submodule_search_locations)[0]
        libs = os.path.join(os.path.dirname(pkg_dir), f"{name}.libs")
        return name, (libs if os.path.isdir(libs) else None)
    return None, None


def ucx_version() -> dict:
    """UCX's version: from the libucp NIXL bundles, else from ``ucx_info -v``."""
    pkg, libs = nixl_libs_dir()
    found = sorted(glob.glob(os.path.join(libs, "libucp*.so*"))) if libs else []
    if found:
        try:
            lib = ctypes.CDLL(found[0])
            lib.ucp_get_version_string.restype = ctypes.c_char_p
            return fact(
                lib.ucp_get_version_string().decode(),
                "queried",
                f"ucp_get_version_string() of the libucp bundled with {pkg}",
            )
        except (OSError, AttributeError) as e:
            err = f"the libucp bundled with {pkg} did not answer: {e}"
    else:
        err = "no libucp bundled with NIXL"
    exe = shutil.which("ucx_info")
    if exe:
        try:
            out = subprocess.run([exe, "-v"], capture_output=True, text=True, timeout=10).stdout
            m = re.search(r"[Vv]ersion:?\s*([\d.]+)", out)
            if m:
                return fact(m.group(1), "queried", f"`ucx_info -v` ({err}); NIXL may load another libucp")
        except (OSError, subprocess.SubprocessError) as e:
            err += f"; ucx_info -v failed: {e}"
    return fact(None, "queried", err + "; no ucx_info on PATH")


def ucx_modules() -> dict:
    """UCX transport modules NIXL bundles (tcp, posix, sysv, self are built in)."""
    pkg, libs = nixl_libs_dir()
    if not libs:
        return fact(None, "queried", "no NIXL package with bundled UCX found")
    names = sorted(
        {
            re.sub(r"\.so.*$", "", os.path.basename(p))[len("libuct_") :]
            for p in glob.glob(os.path.join(libs, "ucx", "libuct_*.so*"))
        }
    )
    return fact(names, "queried", f"libuct_*.so in the UCX modules folder bundled with {pkg}")


def nixl_plugins(agent_plugins: list[str] | None = None) -> dict:
    """NIXL backend plugins: from a running agent if given, else from the plugin folder."""
    if agent_plugins is not None:
        return fact(sorted(agent_plugins), "queried", "nixl_agent.plugin_list")
    env_dir = os.environ.get("NIXL_PLUGIN_DIR")
    pkg, libs = nixl_libs_dir()
    folder = env_dir or (os.path.join(libs, "nixl") if libs else None)
    if not folder or not os.path.isdir(folder):
        return fact(None, "queried", "no NIXL plugin folder found (NIXL not installed?)")
    names = sorted(
        {
            re.sub(r"\.so.*$", "", os.path.basename(p))[len("libplugin_") :]
            for p in glob.glob(os.path.join(folder, "libplugin_*.so*"))
        }
    )
    where = "NIXL_PLUGIN_DIR" if env_dir else f"the plugin folder bundled with {pkg}"
    return fact(names, "queried", f"libplugin_*.so in {where}")
