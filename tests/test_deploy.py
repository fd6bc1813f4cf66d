"""Production packaging without Docker: every package the code imports bounded in pyproject, constraints.txt
against the installed set and pyproject's ranges, deploy/install.sh's steps (run against a stub Python),
deploy/Dockerfile's lines and the Makefile's setup rule."""

from __future__ import annotations

import ast
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from serve_app import kuberay
from serve_app.online.haproxy_launcher import GPU_NODE_ENV

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROD_ENV = yaml.safe_load((ROOT / "configs" / "prod.yaml").read_text())["applications"][0]["runtime_env"]["env_vars"]


def constraints() -> dict[str, str]:
    """{canonical name: pinned version} of constraints.txt."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and "+" not in version, "not an exact public pin: %r" % line
            pins[canonicalize_name(name)] = version.strip()
    return pins


def installed_closure(extras: set[str]) -> dict[str, str]:
    """{canonical name: installed public version} of laya-fleet's installed dependencies with `extras`, and theirs."""
    seen: dict[str, set[str]] = {}

    def walk(name: str, want: set[str]) -> None:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return
        key = canonicalize_name(dist.metadata["Name"])
        if key in seen and want <= seen[key]:
            return
        seen[key] = seen.get(key, set()) | want
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in want or {""}):
                walk(req.name, set(req.extras))

    walk("laya-fleet", extras)
    seen.pop("laya-fleet")
    return {k: Version(metadata.version(k)).public for k in seen}


# -- pyproject's ranges ---------------------------------------------------------------------------------------
FIRST_PARTY = ("model", "kernels", "serve_app")  # the installed packages (tool.setuptools.packages.find)
INSIDE = {"tvm": "tilelang"}  # modules a distribution ships under another name (tilelang's bundled TVM)
# imports of an optional extra's package, which a `.[dev]` install (make test) does not install: named by their
# distribution, which pyproject must still bound
EXTRA_ONLY = {"tilelang": "tilelang"}
CEILINGS = ("<", "<=", "==", "===", "~=")


def _imports() -> dict[str, str]:
    """{top-level module: a file importing it} of every absolute import in the installed packages' code, less
    the standard library and the packages themselves."""
    out: dict[str, str] = {}
    for pkg in FIRST_PARTY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                for name in names:
                    out.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return {m: f for m, f in out.items() if m not in sys.stdlib_module_names and m not in FIRST_PARTY}


def _declared() -> dict[str, Requirement]:
    """{canonical name: requirement} of pyproject's dependencies and every extra's."""
    project = PYPROJECT["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return {canonicalize_name(r.name): r for r in reqs}


def _requires(req: Requirement) -> list[Requirement]:
    """The requirements of installed `req` that apply with the extras it asks for (none where an extra's
    package, tilelang under `.[dev]`, is not installed)."""
    try:
        reqs = [Requirement(r) for r in metadata.requires(req.name) or []]
    except metadata.PackageNotFoundError:
        return []
    return [r for r in reqs if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in req.extras or {""})]


def _capped(req: Requirement) -> bool:
    return any(spec.operator in CEILINGS for spec in req.specifier)


def test_pyproject_bounds_every_dependency_and_extra():
    assert [str(r) for r in _declared().values() if not _capped(r)] == []
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == [p + "*" for p in FIRST_PARTY]


def test_every_imported_package_is_bounded_by_pyproject():
    """Each third-party import of the code is declared with a ceiling, or required with one by a dependency
    that pyproject pins exactly (whose requirements are then fixed too): a fresh `pip install .` cannot pull
    an untested major of anything the code touches."""
    declared, dists = _declared(), metadata.packages_distributions()
    pinned = [r for r in declared.values() if any(s.operator == "==" for s in r.specifier)]
    imports = _imports()
    assert {"torch", "ray", "fastapi", "yaml"} <= set(imports)
    loose = {}
    for module, where in imports.items():
        names = [INSIDE[module]] if module in INSIDE else dists.get(module)
        if not names and module in EXTRA_ONLY:
            names = [EXTRA_ONLY[module]]
        assert names, "%s (imported by %s) belongs to no installed distribution" % (module, where)
        name = canonicalize_name(names[0])
        if name in declared:
            continue
        via = [r for parent in pinned for r in _requires(parent) if canonicalize_name(r.name) == name]
        if not via or not all(_capped(r) for r in via):
            loose[module] = (where, [str(r) for r in via])
    assert loose == {}, "declare these in pyproject.toml with a ceiling: %s" % loose


# -- constraints.txt ------------------------------------------------------------------------------------------
def test_constraints_pin_every_installed_dependency_at_its_installed_version():
    pins, closure = constraints(), installed_closure({"dev"})
    assert {"ray", "torch", "transformers", "pytest", "laya"} <= set(closure)
    assert {k: v for k, v in closure.items() if pins.get(k) != v} == {}


def test_constraints_pin_nothing_beyond_the_dependencies():
    if not installed_closure({"fast"}).get("tilelang"):
        pytest.skip("the fast extra is not installed here: its dependencies cannot be walked")
    assert set(constraints()) - set(installed_closure({"dev", "fast"})) == set()


def test_constraints_satisfy_pyprojects_ranges():
    pins = constraints()
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    reqs += [Requirement(r) for extra in PYPROJECT["project"]["optional-dependencies"].values() for r in extra]
    for req in reqs:
        assert req.specifier.contains(pins[canonicalize_name(req.name)], prereleases=True), str(req)
    assert pins["torch"] == "2.13.0" and pins["ray"] == kuberay.ray_version() == "2.60.0"
    assert "TORCH_CPU ?= torch==%s" % pins["torch"] in (ROOT / "Makefile").read_text()


# -- deploy/install.sh ----------------------------------------------------------------------------------------
@pytest.fixture
def stub_env(tmp_path):
    """(run, log): run(*args, torch=bool, nvidia_smi=bool, **env) runs deploy/install.sh against a stub Python
    that logs each call and imports torch when `torch`; returns the logged calls."""
    log = tmp_path / "calls.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    os.symlink(shutil.which("dirname"), bindir / "dirname")
    python = tmp_path / "stub-python"
    python.write_text('#!/bin/sh\necho "python $*" >> "%s"\n'
                      'if [ "$1" = -c ]; then exit "$STUB_TORCH_MISSING"; fi\n' % log)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    # what `$PY -m venv DIR` runs: makes DIR/bin/python the stub
    maker = tmp_path / "stub-py"
    maker.write_text('#!/bin/sh\necho "py $*" >> "%s"\n%s -p "$3/bin" && %s "%s" "$3/bin/python"\n'
                     % (log, shutil.which("mkdir"), shutil.which("cp"), python))
    maker.chmod(maker.stat().st_mode | stat.S_IEXEC)

    def run(*args, torch=False, nvidia_smi=False, **env):
        if nvidia_smi:
            (bindir / "nvidia-smi").write_text("#!/bin/sh\n")
            (bindir / "nvidia-smi").chmod(0o755)
        log.write_text("")
        e = {"PATH": str(bindir), "PY": str(maker), "STUB_TORCH_MISSING": "0" if torch else "1", **env}
        subprocess.run([shutil.which("bash"), str(ROOT / "deploy" / "install.sh"), *args], env=e, check=True,
                       cwd=tmp_path, timeout=30)
        return log.read_text().splitlines()

    return run, tmp_path


def test_install_creates_the_venv_installs_cpu_torch_then_the_project(stub_env):
    run, tmp = stub_env
    venv = tmp / "venv"
    assert run(str(venv)) == [
        "py -m venv %s" % venv,
        "python -m pip install -q --upgrade pip",
        "python -c import torch",
        "python -m pip install -q torch==2.13.0",
        "python -m pip install -q -c constraints.txt -e .[dev]",
    ]
    # an existing environment is used as it is; $VENV when no argument
    assert run(VENV=str(venv))[0] == "python -m pip install -q --upgrade pip"


@pytest.mark.parametrize("case", ["torch imports", "nvidia-smi", "TORCH_CPU empty"])
def test_install_skips_cpu_torch(stub_env, case):
    run, tmp = stub_env
    kw = {"torch imports": {"torch": True}, "nvidia-smi": {"nvidia_smi": True}, "TORCH_CPU empty": {"TORCH_CPU": ""}}
    calls = run(str(tmp / "venv"), ".[fast]", **kw[case])
    assert not any("install -q torch" in c for c in calls)
    assert calls[-1] == "python -m pip install -q -c constraints.txt .[fast]"


def test_make_setup_runs_the_install_script():
    rule = re.search(r"^\$\(BIN\)/\.installed:(.*)\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    assert rule and set(rule.group(1).split()) == {"pyproject.toml", "constraints.txt", "deploy/install.sh"}
    assert "deploy/install.sh $(VENV)" in rule.group(2) and 'TORCH_CPU="$(TORCH_CPU)"' in rule.group(2)


# -- deploy/Dockerfile ----------------------------------------------------------------------------------------
def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(ln for ln in DOCKERFILE.splitlines() if not ln.lstrip().startswith("#")))
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1].strip()) for ln in text.splitlines() if ln.strip()]


def _env() -> dict[str, str]:
    return dict(a.split("=", 1) for i, a in _instructions() if i == "ENV")


def test_dockerfile_starts_from_the_pinned_ray_gpu_image():
    assert _instructions()[0] == ("FROM", "rayproject/ray:%s-py312-gpu" % kuberay.ray_version())


def test_dockerfile_installs_through_the_script_and_constraints():
    ins = _instructions()
    (n,) = [n for n, (k, a) in enumerate(ins) if k == "RUN" and "deploy/install.sh" in a]
    install = ins[n][1]
    assert re.search(r"(^|\s)TORCH_CPU= ", install), "the CPU torch must not go into the CUDA image"
    assert install.endswith('deploy/install.sh /home/ray/anaconda3 ".[fast]"')
    assert re.search(r'pip install -q -c constraints.txt "\$@"$', (ROOT / "deploy" / "install.sh").read_text(), re.M)
    # everything the install reads is copied in before it
    copied = {p for k, a in ins[:n] if k == "COPY" for p in a.split()[:-1] if not p.startswith("--")}
    packages = {p.rstrip("*").split(".")[0] for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"pyproject.toml", "README.md", "constraints.txt", "deploy/install.sh"} | packages <= copied
    assert all((ROOT / p).exists() for p in copied)


def test_dockerfile_precompiles_the_kernels_for_sm90a_into_the_replicas_local_cache():
    ins = _instructions()
    (i,) = [n for n, (k, a) in enumerate(ins) if k == "RUN" and "laya-fleet precompile" in a]
    assert re.search(r"LAYA_FLEET_TL_ARCH=sm_90a laya-fleet precompile --shapes modernbert-large$", ins[i][1])
    env_before = dict(a.split("=", 1) for k, a in ins[:i] if k == "ENV")
    assert env_before["LAYA_FLEET_LOCAL_CACHE_DIR"] == PROD_ENV["LAYA_FLEET_LOCAL_CACHE_DIR"]
    assert i > [n for n, (k, a) in enumerate(ins) if "deploy/install.sh" in a][0]


def test_dockerfile_sets_the_haproxy_environment():
    env = _env()
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == kuberay.HAPROXY_BINARY
    assert {k: env[k] for k in GPU_NODE_ENV} == GPU_NODE_ENV  # what the KubeRay pods and benchmarks set too
    # the script of the environment the image installs into
    assert kuberay.HAPROXY_BINARY == "/home/ray/anaconda3/bin/laya-fleet-haproxy"
    assert PYPROJECT["project"]["scripts"]["laya-fleet-haproxy"] == "serve_app.haproxy:main"
    assert "LAYA_FLEET_API_KEY" not in env


def test_dockerfile_declares_the_cache_volume():
    (volume,) = [a for i, a in _instructions() if i == "VOLUME"]
    assert volume == '["%s"]' % PROD_ENV["LAYA_FLEET_CACHE_DIR"] == '["/mnt/laya-fleet/cache"]'
    assert _env()["LAYA_FLEET_CACHE_DIR"] == PROD_ENV["LAYA_FLEET_CACHE_DIR"]
