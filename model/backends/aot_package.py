"""Loading an AOTInductor package safely: libstdc++ made global first, and a first load tried in a child process.

`load_aoti_package` is torch's `aoti_load_package` without the crash a statically linked libstdc++ causes and
without inductor's slow CPU ISA probe for a CUDA package; `check_package_loads` loads a package once in a child
before the serving process does, so a package this torch cannot load fails the check, not the replica.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

from .. import settings
from .base import BackendUnavailable

log = logging.getLogger(__name__)
_LOAD_LOCK = threading.Lock()


def _promote_libstdcxx() -> str | None:
    """Make this process's libstdc++ part of the global symbol scope (dlopen RTLD_GLOBAL); returns its path.

    An AOTI package's wrapper .so built by a toolchain that links libstdc++ statically exports its own copy of
    libstdc++'s symbols. Python loads torch's libstdc++ with RTLD_LOCAL, so the package's locale code would bind
    partly to each copy, and its first std::regex calls through a null facet (SIGSEGV). With the process's copy
    global, every such symbol binds to the one copy (as LD_PRELOAD would)."""
    import ctypes

    path = None
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            for line in fh:
                name = line.split()[-1] if line.strip() else ""
                if os.path.basename(name).startswith("libstdc++.so"):
                    path = name
                    break
    except OSError:
        return None
    if path is None:
        import ctypes.util

        path = ctypes.util.find_library("stdc++")
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as e:
        log.warning("could not make %s global before loading an AOTI package: %s", path, e)
        return None
    return path


def load_aoti_package(package: str, device_index: int = -1) -> Any:
    """`torch._inductor.aoti_load_package` with this process's libstdc++ made global first (see
    `_promote_libstdcxx`) and, for a CUDA package, without inductor's CPU ISA probe: torch compares the package's
    CPU ISA with this machine's for a warning only, and finding this machine's compiles test programs and dlopens
    each in a fresh Python (most of a package's load time)."""
    import torch._inductor.codecache as codecache

    _promote_libstdcxx()
    if device_index < 0:  # a CPU package: keep torch's ISA comparison
        return torch._inductor.aoti_load_package(package)

    def without_cpu_isa(device_type: str) -> dict:
        """torch's get_device_information less the CPU ISA (missing keys are not compared)."""
        import platform
        import sys

        from torch._dynamo.device_interface import get_interface_for_device

        return {"AOTI_PLATFORM": sys.platform, "AOTI_MACHINE": platform.machine(),
                "AOTI_COMPUTE_CAPABILITY": str(get_interface_for_device(device_type).get_compute_capability())}

    import torch.export.pt2_archive._package as pkg_mod

    holders = [m for m in (codecache, pkg_mod) if hasattr(m, "get_device_information")]
    with _LOAD_LOCK:
        saved = [(m, m.get_device_information) for m in holders]
        for m in holders:
            m.get_device_information = without_cpu_isa
        try:
            return torch._inductor.aoti_load_package(package, device_index=device_index)
        finally:
            for m, f in saved:
                m.get_device_information = f




def check_package_loads(package: str, device_index: int = -1, timeout_s: float = 600.0,
                        also: Sequence[str] = ()) -> str:
    """Load `package` once in a child process before this process does; returns "ok", "known" or "skipped".

    torch's AOTI runtime loads a package in native code, and a runtime that cannot load it here may crash the
    process instead of raising (see `_promote_libstdcxx`). A serving replica must not die that way, so the first
    load of a package on a node happens in a child: a crash or an error there raises BackendUnavailable naming the
    package and the signal, and a success is remembered next to the package (`<package>.loadable`, keyed by
    torch version and device) so later starts skip the child; `also` names other copies of the same package
    (the shared cache's) whose stamp counts and gets written too (best effort: a read-only mount is fine), so a
    package another node has loaded is trusted. `LAYA_FLEET_AOT_LOAD_CHECK=0` skips the check.
    """
    import json
    import signal
    import subprocess
    import sys

    if not settings.get("LAYA_FLEET_AOT_LOAD_CHECK"):
        return "skipped"
    device = torch.cuda.get_device_name(device_index) if device_index >= 0 else "cpu"
    stamp = {"torch": torch.__version__, "device": device, "size": os.path.getsize(package)}
    markers = [p + ".loadable" for p in (package, *also)]
    for marker in markers:
        try:
            with open(marker, encoding="utf-8") as fh:
                if json.load(fh) == stamp:
                    return "known"
        except (OSError, ValueError):
            pass
    code = ("import sys\n"
            "from model.backends.aot_package import load_aoti_package\n"
            "load_aoti_package(sys.argv[1], int(sys.argv[2]))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        r = subprocess.run([sys.executable, "-c", code, package, str(device_index)], capture_output=True, text=True,
                           timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise BackendUnavailable("loading the AOTInductor package %s took over %.0fs in a test process; not loading "
                                 "it here" % (package, timeout_s)) from None
    if r.returncode < 0:
        try:
            sig = signal.Signals(-r.returncode).name
        except ValueError:
            sig = "signal %d" % -r.returncode
        raise BackendUnavailable(
            "loading the AOTInductor package %s crashed a test process (%s) on %s with torch %s: this torch build's "
            "AOTI runtime cannot load packages here (use backend='fast' or 'compile')" % (package, sig, device,
                                                                                        torch.__version__))
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise BackendUnavailable("the AOTInductor package %s does not load (exit %d): %s" % (package, r.returncode,
                                                                                            tail))
    for marker in markers:
        tmp = "%s.%d.tmp" % (marker, os.getpid())
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(stamp, fh)
            os.replace(tmp, marker)
        except OSError as e:  # a read-only package dir: check again next time
            log.info("could not record that %s loads: %s", marker[:-len(".loadable")], e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return "ok"


__all__ = ["load_aoti_package", "check_package_loads"]
