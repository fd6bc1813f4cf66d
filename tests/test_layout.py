"""The codebase's shape: imports flow serve_app -> model -> kernels, modules stay small, the code speaks of itself."""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 500
# who may not import whom: kernels/ nothing of ours above it, model/ nothing of serve_app/
FORBIDDEN = {"kernels": ("model", "serve_app"), "model": ("serve_app",)}
# history told in code: an ordinal or relative mention of a work session, or a date in a comment
NARRATIVE = re.compile(r"\b(?:(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
                       r"thirteenth|fourteenth|this|last|earlier|previous|next) session|session \d+)\b"
                       r"|^\s*#.*\b20\d\d-\d\d-\d\d\b", re.I)


def _files(top: str, ext: str = ".py"):
    for d, dirs, names in os.walk(os.path.join(ROOT, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for n in sorted(names):
            if n.endswith(ext):
                yield os.path.join(d, n)


def _imported(path: str) -> set[str]:
    """Top-level package names `path` imports, absolute imports and import_module("...") strings alike."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value.split(".")[0].split(":")[0])
    return out


@pytest.mark.parametrize("top", sorted(FORBIDDEN))
def test_imports_flow_one_way(top):
    bad = {os.path.relpath(p, ROOT): sorted(_imported(p) & set(FORBIDDEN[top])) for p in _files(top)}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, "%s/ must not import %s: %s" % (top, " or ".join(FORBIDDEN[top]), bad)


def test_the_import_check_sees_every_form(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import model.x\nfrom serve_app import y\nfrom . import z\n"
                 "import importlib\nimportlib.import_module('model.backends:f')\n")
    assert _imported(str(p)) == {"model", "serve_app", "importlib"}


def test_no_product_module_is_long():
    long = {os.path.relpath(p, ROOT): n for top in ("kernels", "model", "serve_app") for p in _files(top)
            if (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_LINES}
    assert not long, "modules over %d lines: %s" % (MAX_LINES, long)


def test_code_and_configs_do_not_narrate_history():
    found = []
    for top, ext in (("kernels", ".py"), ("model", ".py"), ("serve_app", ".py"), ("bench", ".py"),
                     ("tests", ".py"), ("configs", ".yaml"), ("deploy", "")):
        for p in _files(top, ext):
            if p == os.path.abspath(__file__) or not os.path.isfile(p) or "/data/" in p:
                continue
            for i, line in enumerate(open(p, encoding="utf-8", errors="replace"), 1):
                if NARRATIVE.search(line):
                    found.append("%s:%d: %s" % (os.path.relpath(p, ROOT), i, line.strip()[:100]))
    assert not found, "history belongs in git and BENCHMARKS.md:\n" + "\n".join(found)


def test_the_narrative_check_catches_what_it_names():
    word = "session"  # spelled apart so this file does not itself read as history
    for text in ("measured in the fifth " + word, "(this %s)" % word, "# on 2026-11-30 we saw"):
        assert NARRATIVE.search(text)
    for text in ("session.shared.seed(key)", "an HTTP session", "requests.Session()", 'TEXT = "due 2024-11-30"'):
        assert not NARRATIVE.search(text)
