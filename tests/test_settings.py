"""model/settings.py: the one registry of environment variables, and the README table generated from it."""

from __future__ import annotations

import os
import re

import pytest

from model import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("kernels", "model", "serve_app")


def _product_files():
    for top in PRODUCT:
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith(".py"):
                    yield os.path.join(d, n)


def test_the_readme_table_is_the_registry():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"<!-- settings:begin -->\n(.*?)\n<!-- settings:end -->", text, re.S)
    assert m, "README.md has no <!-- settings:begin --> ... <!-- settings:end --> block"
    assert m.group(1).strip() == settings.markdown_table().strip(), (
        "README's configuration table is stale: paste `python -c 'from model import settings; "
        "print(settings.markdown_table())'` between the markers")


def test_every_variable_the_product_names_is_declared():
    undeclared = {}
    for path in _product_files():
        if path.endswith(os.path.join("model", "settings.py")):
            continue
        for name in re.findall(r"\bLAYA_FLEET_[A-Z0-9_]*[A-Z0-9]", open(path, encoding="utf-8").read()):
            if name not in settings.SETTINGS:
                undeclared.setdefault(name, []).append(os.path.relpath(path, ROOT))
    assert not undeclared, "named in product code but not in model/settings.py: %s" % undeclared


def test_kernels_read_no_environment_of_ours():
    for path in _product_files():
        if os.sep + "kernels" + os.sep in path:
            assert "LAYA_FLEET_" not in open(path, encoding="utf-8").read(), path


def test_values_are_read_when_asked_not_at_import(monkeypatch):
    monkeypatch.delenv("LAYA_FLEET_AOT_BUILD", raising=False)
    assert settings.LAYA_FLEET_AOT_BUILD is False
    monkeypatch.setenv("LAYA_FLEET_AOT_BUILD", "yes")
    assert settings.get("LAYA_FLEET_AOT_BUILD") is True
    monkeypatch.setenv("LAYA_FLEET_AOT_BUILD", "0")
    assert settings.LAYA_FLEET_AOT_BUILD is False


@pytest.mark.parametrize("name,value,words", [
    ("LAYA_FLEET_AOT_LOAD_CHECK", "maybe", "use 1 or 0"),
    ("LAYA_FLEET_COMPILE_REGIONAL", "sometimes", "use one of auto, 0, 1"),
    ("LAYA_FLEET_CUDA_AMP", "fp4", "use one of fp16"),
])
def test_a_value_that_does_not_parse_names_the_variable(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"%s='%s': %s" % (name, value, words)):
        settings.get(name)


def test_upstreams_name_is_read_when_ours_is_unset(monkeypatch):
    monkeypatch.delenv("LAYA_FLEET_CUDA_AMP", raising=False)
    monkeypatch.setenv("LAYA_CUDA_AMP", "BF16")
    assert settings.get("LAYA_FLEET_CUDA_AMP") == "bf16"
    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "fp16")
    assert settings.get("LAYA_FLEET_CUDA_AMP") == "fp16"
    with pytest.raises(ValueError, match="LAYA_CUDA_AMP='x'"):
        settings.get("LAYA_FLEET_CUDA_AMP", {"LAYA_CUDA_AMP": "x"})


def test_paths_are_absolute_and_empty_means_unset(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert settings.get("LAYA_FLEET_CACHE_DIR", {"LAYA_FLEET_CACHE_DIR": "rel/dir"}) == str(tmp_path / "rel" / "dir")
    assert settings.get("LAYA_FLEET_CACHE_DIR", {"LAYA_FLEET_CACHE_DIR": "  "}) is None
    assert settings.get("LAYA_FLEET_COMPILE_REGIONAL", {}) == "auto"


def test_an_undeclared_name_is_an_error_not_none():
    with pytest.raises(KeyError):
        settings.get("LAYA_FLEET_NO_SUCH_THING")
    with pytest.raises(AttributeError):
        settings.LAYA_FLEET_NO_SUCH_THING  # noqa: B018
