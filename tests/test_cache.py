"""The shared compile cache on real files with real processes: one writer, checksums, read-only mounts."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from model import cache
from model.cache import MANIFEST, ArtifactKey, SharedCache

KEY = ArtifactKey("inductor", "ckpt0123456789ab", "cpu-test", (("torch", "0.test"), ("triton", "none")))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _make_src(path: str, writer: int, big: int = 6 << 20) -> dict[str, bytes]:
    """A compiler-cache-like tree whose every file says which writer made it."""
    import random

    rng = random.Random(writer)
    files = {
        "fxgraph/ab/entry": rng.randbytes(big),
        "aotautograd/cd/entry": rng.randbytes(1 << 16),
        "ef/kernel.py": ("# writer %d\n" % writer).encode() * 100,
        "writer.txt": str(writer).encode(),
    }
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as fh:
            fh.write(data)
    # things that must never be published: locks, in-flight temporaries
    os.makedirs(os.path.join(path, "locks"), exist_ok=True)
    open(os.path.join(path, "locks", "x.lock"), "w").close()
    open(os.path.join(path, "ef", ".123.456.tmp"), "w").close()
    return files


def _publisher(shared: str, src: str, lock: bool, barrier, out) -> None:
    barrier.wait()
    out.put((os.getpid(), SharedCache(shared).publish(KEY, src, lock=lock)))


@pytest.mark.parametrize("lock", [True, False], ids=["lock", "rename-only"])
def test_four_processes_publishing_at_once_leave_one_intact_copy(tmp_path, lock):
    shared = str(tmp_path / "shared")
    srcs = []
    for w in range(4):
        src = str(tmp_path / ("src%d" % w))
        _make_src(src, w)
        srcs.append(src)
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_publisher, args=(shared, s, lock, barrier, out)) for s in srcs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    statuses = sorted(out.get(timeout=5)[1] for _ in procs)
    assert statuses.count("published") == 1, statuses
    assert set(statuses) <= {"published", "exists", "busy"}, statuses

    sc = SharedCache(shared)
    assert sc.state(KEY) == "valid"
    parent = os.path.dirname(sc.path(KEY))
    assert os.listdir(parent) == [KEY.name]  # no temporaries, no lock, no second copy
    manifest = json.load(open(os.path.join(sc.path(KEY), MANIFEST)))
    paths = sorted(e["path"] for e in manifest["files"])
    assert paths == ["aotautograd/cd/entry", "ef/kernel.py", "fxgraph/ab/entry", "writer.txt"]
    # every file comes from the same writer (no interleaving of two copies)
    writer = int(open(os.path.join(sc.path(KEY), "writer.txt")).read())
    want = _make_src(str(tmp_path / "expect"), writer)
    for rel, data in want.items():
        assert open(os.path.join(sc.path(KEY), rel), "rb").read() == data, rel


def test_seed_copies_a_valid_artifact_and_reports_a_miss_otherwise(tmp_path):
    sc = SharedCache(str(tmp_path / "shared"))
    dest = str(tmp_path / "local")
    assert sc.seed(KEY, dest).state == "miss"
    files = _make_src(str(tmp_path / "src"), 7)
    assert sc.publish(KEY, str(tmp_path / "src")) == "published"
    assert sc.publish(KEY, str(tmp_path / "src")) == "exists"
    res = sc.seed(KEY, dest)
    assert (res.state, res.files) == ("hit", 4)
    for rel, data in files.items():
        assert open(os.path.join(dest, rel), "rb").read() == data
    assert not [n for n in os.listdir(dest) if n.startswith(".seed-")]


@pytest.mark.parametrize("damage", ["truncate-file", "flip-byte", "truncate-manifest", "no-manifest"])
def test_corrupt_artifact_is_ignored_then_replaced(tmp_path, damage):
    sc = SharedCache(str(tmp_path / "shared"))
    _make_src(str(tmp_path / "a"), 1)
    good = _make_src(str(tmp_path / "b"), 2)
    assert sc.publish(KEY, str(tmp_path / "a")) == "published"
    art = sc.path(KEY)
    if damage == "truncate-file":
        os.truncate(os.path.join(art, "fxgraph/ab/entry"), 1000)
    elif damage == "flip-byte":
        with open(os.path.join(art, "aotautograd/cd/entry"), "r+b") as fh:
            b = fh.read(1)
            fh.seek(0)
            fh.write(bytes([b[0] ^ 0xFF]))
    elif damage == "truncate-manifest":  # a half-written JSON, as a non-atomic copy would leave it
        os.truncate(os.path.join(art, MANIFEST), os.path.getsize(os.path.join(art, MANIFEST)) // 2)
    else:
        os.unlink(os.path.join(art, MANIFEST))
    assert sc.state(KEY) == "corrupt"

    dest = str(tmp_path / "local")
    res = sc.seed(KEY, dest)
    assert res.state == "corrupt"
    assert not os.path.exists(dest) or cache.list_files(dest) == []  # nothing half-verified lands locally

    assert sc.publish(KEY, str(tmp_path / "b")) == "replaced"
    assert sc.state(KEY) == "valid"
    assert os.listdir(os.path.dirname(art)) == [KEY.name]  # the corrupt copy is gone
    assert sc.seed(KEY, dest).state == "hit"
    for rel, data in good.items():
        assert open(os.path.join(dest, rel), "rb").read() == data


def test_abandoned_writer_leftovers_are_ignored(tmp_path):
    """A writer that died mid-copy leaves a .tmp- directory and its lock; readers and writers carry on."""
    sc = SharedCache(str(tmp_path / "shared"))
    parent = os.path.dirname(sc.path(KEY))
    tmp = os.path.join(parent, ".tmp-%s-deadhost-1-abcd" % KEY.name)
    _make_src(tmp, 3)
    os.truncate(os.path.join(tmp, "fxgraph/ab/entry"), 10)
    # a lock held by a process of this host that no longer exists
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket
    with open(os.path.join(parent, ".%s.lock" % KEY.name), "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": dead.pid, "token": "t", "time": 0}, fh)
    assert sc.seed(KEY, str(tmp_path / "local")).state == "miss"
    _make_src(str(tmp_path / "src"), 4)
    assert sc.publish(KEY, str(tmp_path / "src")) == "published"
    assert sc.state(KEY) == "valid"
    assert not os.path.exists(os.path.join(parent, ".%s.lock" % KEY.name))


def test_live_lock_means_busy_and_unsafe_manifest_paths_are_rejected(tmp_path):
    sc = SharedCache(str(tmp_path / "shared"))
    _make_src(str(tmp_path / "src"), 5)
    parent = os.path.dirname(sc.path(KEY))
    os.makedirs(parent)
    import socket
    import time
    lock = os.path.join(parent, ".%s.lock" % KEY.name)
    with open(lock, "w") as fh:
        json.dump({"host": socket.gethostname(), "pid": os.getpid(), "token": "other", "time": time.time()}, fh)
    assert sc.publish(KEY, str(tmp_path / "src")) == "busy"
    assert os.path.exists(lock)  # not ours: left alone
    os.unlink(lock)
    assert sc.publish(KEY, str(tmp_path / "src")) == "published"
    m = json.load(open(os.path.join(sc.path(KEY), MANIFEST)))
    m["files"][0]["path"] = "../../escape"
    json.dump(m, open(os.path.join(sc.path(KEY), MANIFEST), "w"))
    assert sc.read_manifest(KEY) is None
    assert sc.seed(KEY, str(tmp_path / "local")).state == "corrupt"
    assert not os.path.exists(str(tmp_path / "escape"))


def test_filesystem_type_finds_network_mounts(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\nsrv:/export %s nfs4 rw 0 0\nfuse %s fuse.gcsfuse rw 0 0\n"
                      % (tmp_path / "nfs", tmp_path / "gcs"))
    (tmp_path / "nfs" / "cache").mkdir(parents=True)
    (tmp_path / "gcs").mkdir()
    assert cache.filesystem_type(str(tmp_path / "nfs" / "cache" / "not-yet"), str(mounts)) == "nfs4"
    assert cache.filesystem_type(str(tmp_path / "gcs"), str(mounts)) == "fuse.gcsfuse"
    assert cache.filesystem_type(str(tmp_path / "nfsx"), str(mounts)) == "ext4"
    assert cache.is_network_fs("nfs4") and cache.is_network_fs("fuse.gcsfuse") and cache.is_network_fs("lustre")
    assert not cache.is_network_fs("ext4") and not cache.is_network_fs("tmpfs")


def test_local_dirs_follow_the_cache_dir_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.LOCAL_ENV, raising=False)
    monkeypatch.setenv(cache.ENV, str(tmp_path / "from-env"))
    assert cache.resolve_cache_dir() == str(tmp_path / "from-env")
    assert cache.resolve_cache_dir(str(tmp_path / "arg")) == str(tmp_path / "arg")
    assert cache.local_dir("tilelang") == str(tmp_path / "from-env" / "local" / "tilelang")
    monkeypatch.setenv(cache.LOCAL_ENV, str(tmp_path / "node"))
    assert cache.local_dir("triton", str(tmp_path / "arg")) == str(tmp_path / "node" / "triton")
    assert os.path.isdir(str(tmp_path / "node" / "triton"))


# -- read-only shared mount -------------------------------------------------------------------------
_RO_CHILD = textwrap.dedent("""
    import json, logging, os, sys
    records = []
    class H(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())
    logging.getLogger("model.cache").addHandler(H())
    from model import cache
    shared, local = sys.argv[1], sys.argv[2]
    os.environ[cache.LOCAL_ENV] = local
    out = {}
    # what model.load() does: seed the node-local dirs from the (read-only) shared dir
    session = cache.configure(shared, "ckpt0123456789ab", "cpu", kinds={"inductor": None, "tilelang": "0123456789ab"})
    out["seeded"] = {k: v.state for k, v in session.seeded.items()}
    out["files"] = sorted(cache.list_files(session.local["inductor"]))
    with open(os.path.join(session.local["tilelang"], "kernel.so"), "w") as fh:
        fh.write("compiled here")
    # what Engine.warmup() does afterwards: publish what was not seeded
    out["publish1"] = session.publish()
    out["publish2"] = session.publish()
    try:
        open(os.path.join(shared, "probe"), "w")
        out["writable"] = True
    except OSError as e:
        out["writable"] = e.strerror
    out["warnings"] = [r for r in records if "not writable" in r]
    print(json.dumps(out))
""")


def _chmod_dirs(path: str, mode: int) -> None:
    for dirpath, _dirs, _files in os.walk(path):
        os.chmod(dirpath, mode)


def _run_read_only(shared: str, local: str) -> dict:
    cmd = [sys.executable, "-c", _RO_CHILD, shared, local]
    env = dict(os.environ, PYTHONPATH=ROOT)
    if os.geteuid() == 0:
        unshare = shutil.which("unshare")
        if not unshare:
            pytest.skip("root without unshare: cannot make a read-only mount to test against")
        # a private mount namespace with the shared dir bind-mounted read-only: a real EROFS mount
        script = 'mount --bind -o ro "$1" "$1" && shift && exec "$@"'
        cmd = [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh", shared, *cmd]
    else:
        _chmod_dirs(shared, 0o555)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0 and "Operation not permitted" in p.stderr and "mount" in p.stderr:
        pytest.skip("no user namespaces here: %s" % p.stderr.strip()[-200:])
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_read_only_shared_dir_still_works(tmp_path):
    shared = str(tmp_path / "shared")
    key = cache.artifact_key("inductor", "ckpt0123456789ab", "cpu")
    files = _make_src(str(tmp_path / "src"), 9)
    assert SharedCache(shared).publish(key, str(tmp_path / "src")) == "published"
    try:
        out = _run_read_only(shared, str(tmp_path / "node"))
    finally:
        _chmod_dirs(shared, 0o755)
    assert out["writable"] in ("Read-only file system", "Permission denied"), out
    assert out["seeded"] == {"inductor": "hit", "tilelang": "miss"}
    assert out["files"] == sorted(files)
    assert out["publish1"] == {"inductor": "seeded", "tilelang": "readonly"}
    assert out["publish2"] == {"inductor": "seeded", "tilelang": "readonly"}
    assert len(out["warnings"]) == 1, out["warnings"]  # logged once per process
    assert SharedCache(shared).state(key) == "valid"


def test_publish_logs_nothing_for_a_valid_artifact(tmp_path):
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    sc = SharedCache(str(tmp_path / "shared"))
    _make_src(str(tmp_path / "src"), 1)
    assert sc.publish(KEY, str(tmp_path / "src")) == "published"
    handler = Keep(logging.WARNING)
    logging.getLogger("model.cache").addHandler(handler)
    try:
        assert sc.publish(KEY, str(tmp_path / "src")) == "exists"
        assert sc.publish(KEY, str(tmp_path / "empty")) == "empty"
    finally:
        logging.getLogger("model.cache").removeHandler(handler)
    assert not records


def test_the_kernels_fingerprint_covers_every_file_with_kernel_code():
    """Every kernels/ file that builds TileLang code is hashed into the kernel cache key (a new kernel file left out
    would let a changed kernel load its old build); files that only pick and launch kernels are not."""
    import glob
    import os

    from kernels import _tl
    from model.cache import _REPO

    hashed = {os.path.normpath(f) for f in _tl.source_files()}
    builders = set()
    for f in glob.glob(os.path.join(_REPO, "kernels", "*.py")):
        with open(f, encoding="utf-8") as fh:
            src = fh.read()
        if "T.prim_func" in src or "tilelang.compile" in src or "T.Kernel" in src:
            builders.add(os.path.normpath(f))
    assert builders and builders <= hashed, sorted(builders - hashed)
    assert not any(p.endswith(("forward.py", "precompile.py", "tuning.py")) for p in hashed)
