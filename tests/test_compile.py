"""The `compile` and `aot` backends on CPU with the tiny checkpoint, and the shared cache between processes.

Two real processes build concurrently at module start (cold, empty caches): a compile replica that warms
up and publishes its inductor cache, and `laya-fleet aot`. This process then plays the later replica:
it loads from those shared caches into its own node-local dirs.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import model
from model import cache
from model.backends import BackendUnavailable
from model.sequence import Row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV_VARS = (cache.ENV, cache.LOCAL_ENV, "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR",
            "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")

COMPILE_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import torch
import model
from torch._dynamo.utils import counters
e = model.load(sys.argv[1], device="cpu", backend="compile", cache_dir=sys.argv[2], regional=False)
w = e.warmup()
print(json.dumps({"ready_s": time.perf_counter() - t0, "warmup_s": w, "inductor": dict(counters["inductor"]),
                  "graphs": counters["stats"]["unique_graphs"], "cache": e.cache.report(),
                  "precompile": e.backend.precompile_state}))
"""


class Builds:
    """The two cold builds, started together; results are collected on first use."""

    def __init__(self, ckpt: str, tmp: str):
        self.ckpt, self.tmp = ckpt, tmp
        self.compile_shared = os.path.join(tmp, "shared-compile")
        self.aot_shared = os.path.join(tmp, "shared-aot")
        # the same thread count as this process: inductor's CPU code (and so the cache key) depends on it
        base = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(torch.get_num_threads()))
        for k in ENV_VARS:
            base.pop(k, None)
        self._compile = subprocess.Popen(
            [sys.executable, "-c", COMPILE_CHILD, ckpt, self.compile_shared], text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=dict(base, **{cache.LOCAL_ENV: os.path.join(tmp, "node-a")}))
        self._aot = subprocess.Popen(
            [sys.executable, "-m", "model.cli", "aot", "--checkpoint", ckpt, "--cache-dir", self.aot_shared,
             "--device", "cpu"], text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=dict(base, **{cache.LOCAL_ENV: os.path.join(tmp, "node-b")}))
        self._results: dict[str, str] = {}

    def _wait(self, name: str, proc: subprocess.Popen) -> str:
        if name not in self._results:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, err[-4000:]
            self._results[name] = out.strip().splitlines()[-1]
        return self._results[name]

    def compile(self) -> dict:
        """The compile replica's JSON report."""
        return json.loads(self._wait("compile", self._compile))

    def aot(self) -> str:
        """The package path `laya-fleet aot` printed."""
        return self._wait("aot", self._aot)

    def close(self) -> None:
        for p in (self._compile, self._aot):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def builds(tiny_checkpoint, tmp_path_factory):
    b = Builds(tiny_checkpoint, str(tmp_path_factory.mktemp("builds")))
    yield b
    b.close()


def _isolated_env(mp: pytest.MonkeyPatch, local: str) -> None:
    for k in ENV_VARS:  # record every variable load() may set, so all are restored afterwards
        mp.setenv(k, "x")
        mp.delenv(k)
    mp.setenv(cache.LOCAL_ENV, local)
    mp.setattr(cache, "_current", None)
    # the whole graph, which most tests here are about; the default ("auto") has tests of its own
    mp.setenv("LAYA_FLEET_COMPILE_REGIONAL", "0")


def _counters() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], **{k: v for k, v in counters["inductor"].items()}}


@pytest.fixture(scope="module")
def compiled(builds, tiny_checkpoint, tmp_path_factory):
    """(engine, counters before load, counters after warm-up) for a compile replica on the shared cache."""
    builds.compile()  # the first replica has published
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path_factory.mktemp("node-c")))
        before = _counters()
        engine = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=builds.compile_shared)
        engine.warmup()
        yield engine, before, _counters()


def _rows(rng: random.Random, n: int, length: int, k: int, vocab: int) -> list[Row]:
    out = []
    for _ in range(n):
        L = max(4, length - rng.randrange(0, 3))
        ids = [rng.randrange(5, vocab) for _ in range(L)]
        markers = sorted(rng.sample(range(1, L), min(k, L - 1)))
        out.append(Row(ids, markers, rng.randrange(3)))
    return out


def _shapes(max_len: int) -> list[tuple[int, int, int]]:
    """(rows, tokens, markers) over every token bucket boundary up to max_len, single rows included."""
    lengths = [4, 15, 16, 17, 31, 32, 33, 63, 100, 255, 256, 257, 400, max_len - 1, max_len]
    return [((1, 2, 5)[i % 3], L, (1, 2, 3, 7)[i % 4]) for i, L in enumerate(lengths)]


def _compare(backend_engine, eager, shapes, vocab, seed=0, atol=2e-4):
    rng = random.Random(seed)
    worst = 0.0
    for n, L, k in shapes:
        rows = _rows(rng, n, L, k, vocab)
        got, want = backend_engine.score(rows), eager.score(rows)
        assert got[0].shape == want[0].shape, (n, L, k)
        err = float(np.abs(got[0] - want[0]).max())
        worst = max(worst, err)
        assert err < atol, (n, L, k, err)
        assert np.abs(got[1] - want[1]).max() < 1e-5, (n, L, k)
        assert (got[0].argmax(1) == want[0].argmax(1)).all(), (n, L, k)
    return worst


def test_first_replica_compiles_its_one_graph_and_publishes(builds, tiny_checkpoint):
    from model.bundle import checkpoint_hash

    r = builds.compile()
    assert r["cache"]["seeded"]["inductor"]["state"] == "miss"
    assert r["cache"]["published"] == {"inductor": "published"}
    # one graph built by warmup() serves every batch: single rows are padded into it (see _shapes below)
    assert r["graphs"] == 1
    # ... traced once and saved with its guards (precompile), published inside the inductor artifact
    assert r["precompile"] == "built"
    key = cache.artifact_key("inductor", checkpoint_hash(tiny_checkpoint), "cpu")
    assert r["cache"]["keys"]["inductor"] == key.name
    sc = cache.SharedCache(builds.compile_shared)
    assert sc.state(key) == "valid"
    assert os.listdir(os.path.dirname(sc.path(key))) == [key.name]
    blobs = [f for _, _, fs in os.walk(sc.path(key)) for f in fs if f.endswith(".bin")]
    assert len(blobs) == 1


def test_later_replica_loads_its_graph_from_the_shared_cache_without_tracing(compiled):
    engine, before, after = compiled
    assert engine.backend_name == "compile"
    assert engine.cache.seeded["inductor"].state == "hit" and engine.cache.seeded["inductor"].files > 0
    assert engine.cache.published == {"inductor": "seeded"}
    assert engine.backend.precompile_state == "loaded"
    assert after["graphs"] == before["graphs"]  # dynamo traced nothing in this process
    assert after.get("fxgraph_cache_miss", 0) == before.get("fxgraph_cache_miss", 0)


def test_a_batch_the_precompiled_graph_refuses_is_traced_and_answered(builds, tiny_checkpoint, engine, tmp_path):
    from model.backends.padded import padded_batch

    builds.compile()
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        comp = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=builds.compile_shared)
        comp.warmup()
        assert comp.backend.precompile_state == "loaded"
        rows = _rows(random.Random(9), 3, 90, 3, len(engine.bundle.tokenizer))
        b, k = padded_batch(rows, comp.bundle.tokenizer.pad_token_id, comp.backend.min_rows)
        b["input_ids"] = b["input_ids"].to(torch.int32)  # a dtype its guards were not built for
        with torch.no_grad():
            logits, act = comp.backend._run(b)
        assert comp.backend.precompile_misses == 1 and comp.backend.precompile_state == "loaded"
        want = engine.score(rows)
        np.testing.assert_allclose(logits[:3, :k].numpy(), want[0], atol=2e-4)
        # the next ordinary batch still runs in the precompiled graph
        before = _counters()["graphs"]
        got = comp.score(rows)
        assert _counters()["graphs"] == before and comp.backend.precompile_misses == 1
        np.testing.assert_allclose(got[0], want[0], atol=2e-4)


AUTOCAST_CHILD = """
import json, random, sys
import torch
import model
from model.sequence import Row
e = model.load(sys.argv[1], device="cpu", backend="compile", cache_dir=sys.argv[2], regional=False)
e.backend.autocast = torch.bfloat16  # as the backend runs on CUDA: the model in fp32 under bf16 autocast
e.warmup()
rng = random.Random(3)
rows = [Row([rng.randrange(5, 200) for _ in range(L)], [1, 2, 3], 0) for L in (40, 150, 300)]
got = e.score(rows)[0]
print(json.dumps({"precompile": e.backend.precompile_state, "misses": e.backend.precompile_misses,
                  "finite": bool(torch.isfinite(torch.as_tensor(got)).all())}))
"""


def test_a_graph_precompiled_under_autocast_loads_and_serves_in_a_later_replica(tiny_checkpoint, tmp_path):
    # On CUDA the backend runs the fp32 model under bf16 autocast. A saved graph's guards check each input's
    # dispatch keys, which an autocast context around the call changes, so the graph enters autocast itself.
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(torch.get_num_threads()))
    for k in ENV_VARS:
        env.pop(k, None)
    shared = str(tmp_path / "shared")
    out = []
    for node in ("a", "b"):
        p = subprocess.run([sys.executable, "-c", AUTOCAST_CHILD, tiny_checkpoint, shared], text=True,
                           capture_output=True, timeout=900, env=dict(env, **{cache.LOCAL_ENV: str(tmp_path / node)}))
        assert p.returncode == 0, p.stderr[-4000:]
        out.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert out[0] == {"precompile": "built", "misses": 0, "finite": True}
    assert out[1] == {"precompile": "loaded", "misses": 0, "finite": True}


@pytest.mark.parametrize("how", ["precompile off", "corrupt precompiled graph"])
def test_a_replica_without_the_precompiled_graph_traces_and_answers_the_same(builds, tiny_checkpoint, engine,
                                                                             tmp_path, how):
    builds.compile()
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        before = _counters()
        comp = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=builds.compile_shared,
                          precompile=how != "precompile off")
        path = comp.backend.precompile_path()
        if how == "corrupt precompiled graph":
            assert os.path.isfile(path)  # seeded from the shared cache
            with open(path, "wb") as f:
                f.write(b"not a graph")
        else:
            assert path is None
        comp.warmup()
        assert comp.backend.precompile_state == ("off" if how == "precompile off" else "failed: UnpicklingError")
        # traced instead (in this test process dynamo may reuse the graph another test traced for the same code)
        assert _counters()["graphs"] - before["graphs"] <= 1 and comp.backend._pre is None
        _compare(comp, engine, _shapes(engine.bundle.max_len)[:6], len(engine.bundle.tokenizer), seed=4)


def test_compile_matches_eager_and_never_recompiles_after_warmup(compiled, engine):
    comp = compiled[0]
    vocab = len(engine.bundle.tokenizer)
    shapes = _shapes(engine.bundle.max_len)
    graphs = _counters()["graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        worst = _compare(comp, engine, shapes, vocab)
        rng = random.Random(5)  # mixed lengths in one batch
        rows = [r for L in (7, 130, 512, 33, 64) for r in _rows(rng, 1, L, rng.randrange(1, 6), vocab)]
        got, want = comp.score(rows), engine.score(rows)
        assert np.abs(got[0] - want[0]).max() < 2e-4 and np.abs(got[1] - want[1]).max() < 1e-5
    assert _counters()["graphs"] == graphs
    assert comp.backend.precompile_state == "loaded" and comp.backend.precompile_misses == 0  # every shape fit
    assert worst > 0  # a different code path from eager, not eager itself


def test_compile_backend_is_safe_under_concurrent_callers(compiled, engine):
    comp = compiled[0]
    vocab = len(engine.bundle.tokenizer)
    rng = random.Random(11)
    batches = [_rows(rng, n, L, k, vocab) for n, L, k in _shapes(engine.bundle.max_len)]
    want = [comp.score(b) for b in batches]
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(w, len(batches), 4):
                results[i] = comp.score(batches[i])
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    assert not errors, errors
    for i, (lg, act) in enumerate(want):
        np.testing.assert_allclose(results[i][0], lg, atol=1e-6)
        np.testing.assert_allclose(results[i][1], act, atol=1e-7)


def test_aot_package_round_trips_and_answers_like_eager(builds, tiny_checkpoint, engine, tmp_path):
    path = builds.aot()
    assert path.startswith(os.path.join(builds.aot_shared, "shared")) and path.endswith("model.pt2")
    assert os.path.getsize(path) > 0
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node-d"))
        before = _counters()
        aot = model.load(tiny_checkpoint, device="cpu", backend="aot", cache_dir=builds.aot_shared)
        assert aot.backend_name == "aot"
        assert aot.backend.load_check == "ok"  # first load on this node went through a child process
        assert aot.cache.seeded["aoti"].state == "hit"  # copied from the shared cache, not built
        aot.warmup()
        _compare(aot, engine, _shapes(engine.bundle.max_len), len(engine.bundle.tokenizer), seed=3)
        assert _counters() == before  # nothing was compiled in this process


def test_a_package_that_does_not_load_is_refused_before_this_process_loads_it(builds, tmp_path):
    from model.backends.aot_package import check_package_loads

    good = str(tmp_path / "good.pt2")
    shutil.copyfile(builds.aot(), good)
    assert check_package_loads(good) == "ok"
    assert check_package_loads(good) == "known"  # remembered next to the package: no second child
    assert os.path.isfile(good + ".loadable")
    bad = str(tmp_path / "bad.pt2")
    with open(good, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read()[: os.path.getsize(good) // 3])  # a truncated copy
    with pytest.raises(BackendUnavailable, match="bad.pt2 does not load"):
        check_package_loads(bad)
    assert not os.path.exists(bad + ".loadable")


def test_aot_without_a_package_names_the_build_command(tiny_checkpoint, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        with pytest.raises(BackendUnavailable, match="laya-fleet aot --checkpoint"):
            model.load(tiny_checkpoint, device="cpu", backend="aot", cache_dir=str(tmp_path / "empty"))


def test_regional_compile_builds_one_graph_per_kind_of_layer_and_matches_eager(tiny_checkpoint, engine, tmp_path):
    # regional mode: the encoder's layers call one compiled function of tensors; layers of a kind share its graph
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        before = _counters()["graphs"]
        comp = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "shared"),
                          regional=True)
        comp.warmup()
        be = comp.backend
        assert be.regional and be.precompile_path() is None and be._compiled is None
        types = be.model.encoder.layer_types
        kinds = len({(i == 0, t) for i, t in enumerate(types)})  # layer 0's norm is the identity
        assert len(types) > kinds == 3
        assert _counters()["graphs"] - before == kinds
        with torch._dynamo.config.patch(error_on_recompile=True):
            worst = _compare(comp, engine, _shapes(engine.bundle.max_len), len(engine.bundle.tokenizer), seed=8)
        assert _counters()["graphs"] - before == kinds  # no shape after warm-up compiled anything
        assert worst > 0


def test_loading_a_package_makes_the_process_libstdcxx_global():
    """An AOTI package that links libstdc++ statically crashes in its own std::regex unless the process's libstdc++
    is in the global symbol scope (as LD_PRELOAD puts it); load_aoti_package promotes it first."""
    code = textwrap.dedent("""
        import ctypes, json, torch
        from model.backends.aot_package import _promote_libstdcxx
        sym = "_ZNSt6locale7classicEv"  # std::locale::classic()
        before = hasattr(ctypes.CDLL(None), sym)
        path = _promote_libstdcxx()
        print(json.dumps({"before": before, "after": hasattr(ctypes.CDLL(None), sym), "path": path}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["before"] is False   # torch loads libstdc++ with RTLD_LOCAL: not global until promoted
    assert got["after"] is True and os.path.basename(got["path"]).startswith("libstdc++.so")


@pytest.mark.parametrize("cfg, env, want", [
    ({"amp_dtype": "bf16"}, {}, torch.bfloat16),
    ({"amp_dtype": "bfloat16"}, {}, torch.bfloat16),
    ({"amp_dtype": "fp16"}, {}, torch.float16),
    ({}, {}, torch.float16),  # upstream's default when the field is absent
    ({"amp_dtype": "bf16"}, {"LAYA_FLEET_CUDA_AMP": "fp16"}, torch.float16),
    ({"amp_dtype": "fp16"}, {"LAYA_CUDA_AMP": "BF16"}, torch.bfloat16),  # upstream's variable is honoured too
    ({"amp_dtype": "fp16"}, {"LAYA_FLEET_CUDA_AMP": "bfloat16", "LAYA_CUDA_AMP": "fp16"}, torch.bfloat16),
])
def test_cuda_autocast_dtype_follows_the_checkpoint_and_the_environment(monkeypatch, cfg, env, want):
    from model.backends import cuda_amp_dtype

    for var in ("LAYA_FLEET_CUDA_AMP", "LAYA_CUDA_AMP"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cuda_amp_dtype(cfg) == want


def test_a_bad_autocast_setting_names_the_variable(monkeypatch):
    from model.backends import cuda_amp_dtype

    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "int8")
    with pytest.raises(ValueError, match="LAYA_FLEET_CUDA_AMP='int8'"):
        cuda_amp_dtype({"amp_dtype": "bf16"})
    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "fp8")   # a precision, but the fast backend's alone
    with pytest.raises(ValueError, match="fp8 \\(from LAYA_FLEET_CUDA_AMP\\) runs on the fast backend only"):
        cuda_amp_dtype({"amp_dtype": "bf16"})


def test_a_bad_compile_dtype_names_the_option(tiny_checkpoint, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        with pytest.raises(ValueError, match="dtype='int8'"):
            model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "c"), dtype="int8")


def test_aot_packages_of_different_dtypes_have_different_keys():
    from model.backends.aot import aot_variant

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [aot_variant(cuda, dt) for dt in (torch.bfloat16, torch.float16, None)] == ["bf16", "fp16", "bf16"]
    assert aot_variant(cpu, torch.float16) == "fp32"
    keys = {cache.artifact_key("aoti", "abc", cpu, variant=aot_variant(cuda, dt), arch="sm_90").name
            for dt in (torch.bfloat16, torch.float16)}
    assert len(keys) == 2


def test_regional_auto_compiles_regionally_on_an_empty_cache_and_loads_a_cached_whole_graph(builds, tiny_checkpoint,
                                                                                            tmp_path):
    """regional="auto": no precompiled whole graph in the seeded cache -> one graph per kind of layer (the shorter
    cold compile); the whole graph once a replica has published it -> loaded, nothing traced."""
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node1"))
        cold = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "empty"),
                          regional="auto")
        assert cold.backend.regional is True and cold.backend.regional_choice.startswith("auto: regional")
    builds.compile()  # a replica that compiled the whole graph and published it
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node2"))
        mp.setenv("LAYA_FLEET_COMPILE_REGIONAL", "auto")
        warm = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=builds.compile_shared)
        assert warm.backend.regional is False and warm.backend.regional_choice.startswith("auto: whole graph")
        warm.warmup()
        assert warm.backend.precompile_state == "loaded"


def test_the_default_is_auto_so_a_cold_replica_compiles_regionally(tiny_checkpoint, tmp_path):
    """No option and no variable: "auto", so a replica on an empty cache takes the short regional compile."""
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        mp.delenv("LAYA_FLEET_COMPILE_REGIONAL")
        e = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "empty"))
        assert e.backend.regional is True and e.backend.regional_choice.startswith("auto: regional")


def test_unaligned_compile_is_never_regional(tiny_checkpoint, tmp_path):
    """align=False (the memory benchmark's unaligned graph) cannot take the regional layers' [rows, tokens/16, 16]
    views: "auto" compiles the whole graph, an explicit regional=True is refused with the reason."""
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        mp.delenv("LAYA_FLEET_COMPILE_REGIONAL")
        e = model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "c"), align=False)
        assert e.backend.regional is False and e.backend.regional_choice == "auto: whole graph (align=False)"
        with pytest.raises(ValueError, match="needs align=True"):
            model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "c"), align=False,
                       regional=True)


def test_a_bad_regional_setting_names_the_variable(tiny_checkpoint, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        _isolated_env(mp, str(tmp_path / "node"))
        mp.setenv("LAYA_FLEET_COMPILE_REGIONAL", "sometimes")
        with pytest.raises(ValueError, match="LAYA_FLEET_COMPILE_REGIONAL='sometimes'"):
            model.load(tiny_checkpoint, device="cpu", backend="compile", cache_dir=str(tmp_path / "c"))
