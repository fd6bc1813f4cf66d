"""The checkpoints one application serves: their served names, directories and scorer deployment names.

A served name is one of upstream's (`english`, `multilingual`, `typed-decisions`; an alias such as `ml` is
taken for its name) or any other name of lowercase letters, digits, `.`, `_` and `-`. The default checkpoint
(`AppArgs.checkpoint`) is scored by the deployment `Scorer`, the one a single-checkpoint config's
`deployments: [{name: Scorer}]` entry names; every other checkpoint by `Scorer-<served name>`.
"""

from __future__ import annotations

import os
import re

from .routing import canonical_name

UPSTREAM_NAMES = ("english", "multilingual", "typed-decisions")
DEFAULT_DEPLOYMENT = "Scorer"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def canonical(name: str) -> str:
    """The served name `name` stands for: trimmed, lowercased, an upstream alias resolved; ValueError for a
    name that cannot be served (a path, a Hub id, an empty string)."""
    key = canonical_name(name)
    if not _NAME_RE.match(key):
        raise ValueError("checkpoint name %r is not a served name: use lowercase letters, digits, '.', '_' and "
                         "'-', starting with a letter or digit (a directory goes on the right-hand side)" % name)
    return key


def deployment_name(name: str, default: str) -> str:
    """The scorer deployment of served checkpoint `name`: `Scorer` for the default, else `Scorer-<name>`."""
    return DEFAULT_DEPLOYMENT if name == default else "%s-%s" % (DEFAULT_DEPLOYMENT, name)


def served(checkpoint: str | None, checkpoints: dict[str, str] | None, default: str) -> dict[str, str]:
    """{served name: directory}, the default first: `checkpoint` is the default's directory (it may instead be
    an entry of `checkpoints`), `checkpoints` names the others. ValueError for a clash or no default."""
    default = canonical(default)
    out: dict[str, str] = {}
    for name, path in (checkpoints or {}).items():
        key = canonical(name)
        if key in out:
            raise ValueError("checkpoints: %r and another entry both name checkpoint %r" % (name, key))
        if not isinstance(path, str) or not path.strip():
            raise ValueError("checkpoints: %r must name a checkpoint directory" % name)
        out[key] = path
    if checkpoint is not None:
        if default in out and os.path.normpath(out[default]) != os.path.normpath(checkpoint):
            raise ValueError("checkpoint %r and checkpoints.%s %r name two directories for the default checkpoint"
                             % (checkpoint, default, out[default]))
        out[default] = checkpoint
    if default not in out:
        raise ValueError("no directory for the default checkpoint %r: set `checkpoint` or checkpoints.%s"
                         % (default, default))
    return {default: out.pop(default), **out}
