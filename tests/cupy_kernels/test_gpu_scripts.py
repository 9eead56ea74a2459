"""scripts/gpu_check.sh, its helpers (scripts/gpu_kit.py, scripts/gpu_pytest_record.py,
scripts/ci_gpu_kit.sh) and the GPU benchmarks' output, checked on a machine without a GPU.

The whole kit against the image's packages (downloads, a Python 3.12 venv) is scripts/ci_gpu_kit.sh's job,
in .ci/run; these tests cover its parts without the network."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.cupy_kernels.cuda import modules as cuda_modules

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
KIT = ROOT / "scripts" / "gpu_kit.py"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
without_cupy = pytest.mark.skipif(importlib.util.find_spec("cupy") is not None,
                                  reason="CuPy is installed: the script would run")


def _kit():
    spec = importlib.util.spec_from_file_location("gpu_kit", KIT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_kit"] = mod
    spec.loader.exec_module(mod)
    return mod


gpu_kit = _kit()


@needs_bash
@pytest.mark.parametrize("script", ["gpu_check.sh", "ci_gpu_kit.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], check=True, timeout=30)


def _real_run_env(tmp_path: Path, **extra) -> dict:
    """The real run with this interpreter, an empty .gpu_check (nothing carried) and OUT in tmp_path."""
    (tmp_path / "kit").mkdir(exist_ok=True)
    return {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out"),
            "GPU_CHECK_DIR": str(tmp_path / "kit"), "GPU_CHECK_SLOW_HOST": "1", **extra}


@needs_bash
@without_cupy
def test_without_cupy_the_real_run_checks_everything_before_the_gpu_then_exits_2(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], env=_real_run_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no usable GPU" in proc.stderr and "cupy" in proc.stderr.lower()
    result = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert result["exit_code"] == 2 and "cupy" in result["preflight"]["no_gpu"].lower()
    assert result["install"]["note"] == "nothing carried"
    # every pagedserve module imported, every requirement met, the GPU tests collected - before the preflight
    assert result["imports"]["failed"] == {} and result["imports"]["imported"] > 50
    assert result["environment"]["requirements"]["numpy"]["ok"]
    assert result["collected"]["exit_code"] == 0 and result["collected"]["gpu_tests"] > 20
    assert not any(k.startswith("tests_") for k in result)  # stopped before them
    # the collection split into the run's test steps, as lists of node ids next to the step records
    steps = tmp_path / "out" / "steps"
    split = {n: (steps / f"{n}.txt").read_text().split()
             for n in ("tests_runtime", "tests_kernels", "tests_regression")}
    assert all(split.values()) and sum(map(len, split.values())) == result["collected"]["gpu_tests"]
    assert "gpu_check: no usable GPU" in (tmp_path / "out" / "gpu_check.log").read_text()


@pytest.mark.parametrize("bench", ["gpu_attention.py", "gpu_decode.py", "gpu_sampler.py"])
def test_gpu_benchmarks_import_without_cupy(bench):
    """--help runs before CuPy is imported: the import chain needs only numpy and pagedserve."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['{bench}', '--help']\n"
            "sys.modules['tokenizers'] = sys.modules['safetensors'] = sys.modules['gguf'] = None\n"
            "sys.modules['grpc'] = sys.modules['structlog'] = sys.modules['jinja2'] = None\n"
            f"runpy.run_path({str(ROOT / 'bench' / bench)!r}, run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout


@pytest.mark.parametrize("bench", ["gpu_attention.py", "gpu_decode.py", "gpu_sampler.py"])
def test_a_benchmark_prints_only_its_json_on_stdout_whatever_logs_on_the_way(bench):
    """On the H200 a structlog warning on stdout ahead of the JSON lost every decode figure: each
    benchmark's emit_json sends anything printed while it runs - Python prints, structlog's default
    logger, a C library writing to fd 1 - to stderr, and then the JSON alone to stdout."""
    code = ("import os, runpy, sys\n"
            f"ns = runpy.run_path({str(ROOT / 'bench' / bench)!r}, run_name='not_main')\n"
            "def noisy():\n"
            "    print('a print on the way')\n"
            "    import structlog\n"
            "    structlog.get_logger().warning('cuda_graphs.capture_failed', batch_size=8)\n"
            "    os.write(1, b'raw bytes on fd 1\\n')\n"
            "    return {'benchmark': 'x', 'figure': 1.5}\n"
            "ns['emit_json'](noisy)\n"
            "print('after', file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"benchmark": "x", "figure": 1.5}
    for noise in ("a print on the way", "cuda_graphs.capture_failed", "raw bytes on fd 1"):
        assert noise in proc.stderr and noise not in proc.stdout


def _script_copy(tmp_path: Path) -> Path:
    """The script in an empty tree (its ROOT): no .gpu_check folder there."""
    (tmp_path / "scripts").mkdir()
    copy = tmp_path / "scripts" / "gpu_check.sh"
    shutil.copy(SCRIPT, copy)
    return copy


@needs_bash
def test_unknown_arguments_and_an_unprepared_dry_run_exit_5(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 5 and "unknown argument --bogus" in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT), "--prepare", "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 5 and "unknown argument --bogus" in proc.stderr
    proc = subprocess.run(["bash", str(_script_copy(tmp_path)), "--dry-run"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 5 and "run scripts/gpu_check.sh --prepare first" in proc.stderr


@needs_bash
def test_ci_step_says_so_and_passes_where_python_3_12_is_missing(tmp_path):
    """Only bash and the few tools the script needs before its check: no python3.12, pyenv or uv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mktemp", "rm"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run([str(bin_dir / "bash"), str(ROOT / "scripts" / "ci_gpu_kit.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ci_gpu_kit: SKIPPED, the GPU kit was NOT checked: no Python 3.12" in proc.stdout


# -- the package sets ---------------------------------------------------------------------------------------

def _image(packages: dict) -> dict:
    return {"date": "2026-12-04", "python": "3.12.3", "glibc": "2.31", "packages": packages}


def _wheel(name: str, version: str, *requires: str) -> dict:
    return {"name": name, "version": version, "requires": list(requires), "file": f"{name}-{version}.whl",
            "size": 1000}


def test_resolve_carries_what_the_image_lacks_or_holds_too_old_and_follows_only_carried_wheels():
    Req = gpu_kit.Requirement
    image = _image({"numpy": "2.5.2", "tqdm": "*", "grpcio": "~1.78.0", "numba": "0.68.0"})
    env = gpu_kit.target_environment(image)
    wheels = {"gguf": _wheel("gguf", "0.19.0", "numpy>=1.17", "tqdm>=4.27"),
              "grpcio": _wheel("grpcio", "1.85.3"),
              "numpy": _wheel("numpy", "2.4.6"),  # downloaded as gguf's dependency, the image has one
              "structlog": _wheel("structlog", "26.1.0", "typing-extensions; python_version < '3.11'")}
    top = [(Req(s), "pyproject runtime") for s in
           ("numpy>=1.26", "gguf>=0.10", "grpcio>=1.85.1", "numba>=0.68,<0.69", "structlog>=24.1",
            "pywin32; sys_platform == 'win32'")]
    res = gpu_kit.resolve(top, wheels, image, env)
    assert res["missing"] == []
    assert sorted(res["carried"]) == ["gguf", "grpcio", "structlog"]  # the stand-in grpcio is older
    assert sorted(res["image"]) == ["numba", "numpy", "tqdm"]  # numpy 2.5.2 >= 1.26 and >= 1.17; tqdm any
    assert "typing-extensions" not in res["needs"] and "pywin32" not in res["needs"]  # markers for 3.12, Linux


def test_resolve_names_a_requirement_neither_carried_nor_on_the_image():
    Req = gpu_kit.Requirement
    image = _image({"numpy": "2.5.2"})
    wheels = {"newlib": _wheel("newlib", "1.0", "numpy>=3.0", "helper>=2")}
    res = gpu_kit.resolve([(Req("newlib>=1"), "pyproject runtime")], wheels, image,
                          gpu_kit.target_environment(image))
    assert len(res["missing"]) == 2
    helper_msg, numpy_msg = sorted(res["missing"])
    assert "helper>=2 (needed by newlib 1.0)" in helper_msg and "the image does not have it" in helper_msg
    assert "numpy>=3.0" in numpy_msg and "the image has 2.5.2" in numpy_msg
    assert "neither carried nor on the image" in numpy_msg


def test_the_committed_image_list_and_pyproject_give_the_sets_of_the_first_gpu_run():
    """With the image as recorded (scripts/gpu_image_packages.txt), pyproject's runtime dependencies split
    as the 2026-12-04 run found: grpcio, protobuf, gguf, structlog, llguidance and the grpc health and
    reflection packages travel; numpy, numba, threadpoolctl and prometheus-client are the image's."""
    image = gpu_kit.load_image()
    assert image["date"] and image["python"].startswith("3.12") and image["packages"]["numpy"] == "2.5.2"
    env = gpu_kit.target_environment(image)
    # (a requirement whose marker excludes the image's Python, as tomli's on 3.12, is not the image's to decide)
    top = [(r, g) for r, g in gpu_kit.project_requirements() if g == "runtime" and gpu_kit.marker_ok(r, env)]
    def allowed(r) -> str:  # a version the requirement takes: its lower bound, or a far newer one
        return next(v for v in [*(s.version for s in r.specifier), "999.0"] if r.specifier.contains(v))

    wheels = {gpu_kit.canon(r.name): _wheel(r.name, allowed(r)) for r, _ in top}
    res = gpu_kit.resolve(top, wheels, image, env)
    assert res["missing"] == []
    decided = {n: "carried" for n in res["carried"]} | {n: "image" for n in res["image"]}
    assert {gpu_kit.canon(r.name) for r, _ in top} == set(decided)  # every runtime dependency decided
    for name in ("grpcio", "protobuf", "gguf", "structlog", "llguidance", "grpcio-health-checking",
                 "grpcio-reflection"):
        assert decided[name] == "carried", name
    for name in ("numpy", "numba", "threadpoolctl", "prometheus-client"):
        assert decided[name] == "image", name


def test_platform_tags_reach_the_images_glibc():
    args = gpu_kit.platform_args(_image({}))
    tags = [args[i + 1] for i, a in enumerate(args) if a == "--platform"]
    assert "manylinux_2_31_x86_64" in tags and "manylinux_2_17_x86_64" in tags  # llguidance 1.9.1 needs 2_31
    assert "manylinux_2_32_x86_64" not in tags
    assert args[args.index("--python-version") + 1] == "3.12"


# -- the environment check -----------------------------------------------------------------------------------

def test_check_env_names_the_first_missing_module(tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\ndependencies = []\n[project.optional-dependencies]\ntest = []\n'
        '[tool.setuptools]\npackages = ["pagedserve.zz_fake"]\n'
        '[tool.setuptools.package-dir]\n"pagedserve.zz_fake" = "zz_fake"\n')
    pkg = tmp_path / "zz_fake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("X = 1\n")
    (pkg / "needs_it.py").write_text("import not_a_module_the_image_has_xyz\n")
    src = tmp_path / "src"
    (src / "pagedserve").mkdir(parents=True)
    (src / "pagedserve" / "zz_fake").symlink_to(pkg)
    out = tmp_path / "env.json"
    proc = subprocess.run([sys.executable, str(KIT), "check-env", "--out", str(out), "--root", str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    result = json.loads(out.read_text())
    assert result["imports"]["first_missing"] == {"module": "not_a_module_the_image_has_xyz",
                                                  "imported_by": "pagedserve.zz_fake.needs_it"}
    assert list(result["imports"]["failed"]) == ["pagedserve.zz_fake.needs_it"]
    assert result["imports"]["imported"] == 2  # the package and fine.py
    assert "first missing module: not_a_module_the_image_has_xyz" in proc.stderr


def test_link_source_makes_every_pyproject_package_importable_from_the_checkout(tmp_path):
    subprocess.run([sys.executable, str(KIT), "link-source", "--dest", str(tmp_path)], check=True, timeout=60)
    linked = sorted(p.name for p in (tmp_path / "pagedserve").iterdir())
    assert linked == sorted(gpu_kit.package_dirs()) and "runtime" in linked
    assert (tmp_path / "pagedserve" / "runtime").resolve() == ROOT / "runtime"


# -- results that survive a kill ---------------------------------------------------------------------------------

def test_the_record_plugin_keeps_failures_and_unfinished_tests_when_the_budget_kills_the_run(tmp_path):
    """A SIGTERM (what `timeout` sends) in the middle of the suite: the failure before it keeps its message,
    the running test and those after it are named, and pytest still writes its JUnit file."""
    (tmp_path / "test_budget.py").write_text(
        "import os, signal\n"
        "def test_a_passes():\n    assert True\n"
        "def test_b_fails():\n    assert 1 + 1 == 3, 'arithmetic is off'\n"
        "def test_c_is_cut_by_the_budget():\n    os.kill(os.getpid(), signal.SIGTERM)\n"
        "def test_d_never_starts():\n    assert True\n")
    record = tmp_path / "tests.jsonl"
    env = {**os.environ, "GPU_TEST_RECORD": str(record), "PYTHONPATH": str(ROOT / "scripts")}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_pytest_record",
                           f"--junitxml={tmp_path / 'junit.xml'}", "test_budget.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:]  # interrupted
    assert (tmp_path / "junit.xml").exists()
    summary = gpu_kit.test_summary(gpu_kit.read_test_records(record), proc.returncode)
    assert summary["collected"] == 4 and summary["passed"] == 1 and summary["failed"] == 1
    assert summary["failed_tests"][0]["test"].endswith("test_b_fails")
    assert "arithmetic is off" in summary["failed_tests"][0]["message"]
    states = {t["test"].split("::")[-1]: t["state"] for t in summary["unfinished_tests"]}
    assert states == {"test_c_is_cut_by_the_budget": "running when the run stopped",
                      "test_d_never_starts": "not started"}


def _work_dir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "steps.txt").write_text("install 0 1\nenvironment 0 2\ncollect 0 3\npreflight 0 4\ngemm_probe 124 25\n"
                                    "tests_runtime 124 60\nbench_attention 0 20\nbench_decode 0 30\n")
    (work / "preflight.json").write_text(json.dumps({"device": "Fake H200", "nvrtc": "ok", "cublas": "ok",
                                                     "curand": "ok"}))
    (work / "environment.json").write_text(json.dumps({"ok": True, "problems": [], "requirements": {},
                                                       "imports": {"imported": 95, "failed": {},
                                                                   "first_missing": None}}))
    (work / "collect.log").write_text("tests/cupy_kernels/test_x.py::test_a\n\n3/10 tests collected (7 deselected)\n")
    lines = [{"event": "collected", "nodeids": ["t.py::a", "t.py::b", "t.py::c"]},
             {"event": "start", "nodeid": "t.py::a"},
             {"event": "report", "nodeid": "t.py::a", "when": "setup", "outcome": "passed", "duration": 0.1},
             {"event": "report", "nodeid": "t.py::a", "when": "call", "outcome": "failed", "duration": 3.0,
              "message": "AssertionError: capture failed", "detail": "E   AssertionError: capture failed"},
             {"event": "report", "nodeid": "t.py::a", "when": "teardown", "outcome": "passed", "duration": 0.0},
             {"event": "start", "nodeid": "t.py::b"}]
    cut = '\n{"event": "rep'  # a line cut by a kill
    (work / "tests_runtime.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + cut)
    (work / "bench_attention.out").write_text(json.dumps({"benchmark": "paged_attention",
                                                          "headline_pct_of_peak_bandwidth": 54.3}))
    (work / "bench_attention.rc").write_text("0\n")
    # what the H200 printed: a structlog warning on stdout ahead of the JSON
    (work / "bench_decode.out").write_text("2026-12-04 18:41:10 [warning  ] cuda_graphs.capture_failed\n"
                                           + json.dumps({"benchmark": "decode_step"}))
    (work / "bench_decode.rc").write_text("0\n")
    # the probe killed at its cap after one route: stdout empty, its partial JSON kept
    (work / "gemm_probe.out").write_text("")
    (work / "gemm_probe.rc").write_text("124\n")
    (work / "gemm_probe.partial.json").write_text(json.dumps({"probe": "gemm_capture", "routes": [
        {"route": "ctypes", "capture_ok": True}], "unfinished": ["nvmath"]}))
    return work


def test_results_name_every_unfinished_test_and_fail_loudly_on_a_benchmark_that_does_not_parse(tmp_path, capsys):
    work = _work_dir(tmp_path)
    rc = gpu_kit.results(work, tmp_path / "out", {"per_test_timeout_s": 45})
    result = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert rc == 1 and result["exit_code"] == 1
    tests = result["tests_runtime"]
    assert tests["failed_tests"] == [{"test": "t.py::a", "message": "AssertionError: capture failed",
                                      "detail": "E   AssertionError: capture failed"}]
    assert [(t["test"], t["state"]) for t in tests["unfinished_tests"]] == [
        ("t.py::b", "running when the run stopped"), ("t.py::c", "not started")]
    assert result["bench_attention"]["headline_pct_of_peak_bandwidth"] == 54.3
    assert result["bench_decode"]["ok"] is False and "did not parse as JSON" in result["bench_decode"]["error"]
    assert "cuda_graphs.capture_failed" in result["bench_decode"]["stdout_head"][0]
    assert result["bench_sampler"] == {"ok": False, "error": "not run: the time budget ran out"}
    assert any("tests_runtime ran out of its time" in f for f in result["failures"])
    assert any("tests_kernels: not run" in f for f in result["failures"])
    probe = result["gemm_probe"]
    assert probe["ok"] is False and "timed out" in probe["error"]
    assert probe["partial"]["routes"] == [{"route": "ctypes", "capture_ok": True}]
    assert "BENCH_DECODE FAILED" in capsys.readouterr().err


def test_after_a_step_the_results_say_not_run_yet_and_fail_nothing_that_has_not_had_its_turn(tmp_path):
    work = _work_dir(tmp_path)
    gpu_kit.results(work, tmp_path / "out", {"per_test_timeout_s": 45, "final": False})
    result = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert result["bench_sampler"] == {"ok": False, "error": "not run yet"}
    assert not any("bench_sampler" in f or "tests_kernels" in f for f in result["failures"])
    assert any("bench_decode" in f for f in result["failures"])  # it ran, and its output did not parse


def test_the_collection_splits_into_the_steps_new_evidence_first():
    ids = ["tests/cupy_kernels/test_gpu_runtime.py::test_decode_graph_replays_match_eager_steps[tiny-llama]",
           "tests/cupy_kernels/test_gpu_runtime.py::test_graph_pool_draws_only_from_the_reserved_arena",
           "tests/cupy_kernels/test_gpu_runtime.py::test_sampler_on_device_matches_numpy",
           "tests/cupy_kernels/test_gpu_runtime.py::test_kv_sizing_fills_gpu_memory_utilization",
           "tests/cupy_kernels/test_device_sampler.py::test_kernel_on_gpu_matches_the_reference_and_passes_chi_square",
           "tests/cupy_kernels/test_prefill_tc_gpu.py::test_prefill_attention_tensor_cores_gpu[64-16-2-None-f16]",
           "tests/cupy_kernels/test_cuda_ops.py::test_paged_attention_head_dim_256[4-16]",
           "tests/cupy_kernels/test_cuda_ops.py::test_sliding_window_head_dim_256[37]",
           "tests/cupy_kernels/test_cuda_ops.py::test_paged_attention_matches_reference[64-16-1]",
           "tests/cupy_kernels/test_seeded_models.py::test_seeded_model_on_gpu_matches_the_cpu_reference[x]"]
    split = gpu_kit.split_tests(ids)
    assert [i.split("::")[1][:22] for i in split["tests_runtime"]] == [
        "test_decode_graph_repl", "test_graph_pool_draws_", "test_sampler_on_device", "test_kernel_on_gpu_mat"]
    assert split["tests_kernels"] == ids[5:8]
    assert split["tests_regression"] == [ids[3]] + ids[8:]


@needs_bash
def test_the_plan_runs_the_new_evidence_first_and_fits_eight_minutes():
    proc = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    steps = [ln.split()[0] for ln in lines[:-1]]
    assert steps == ["install", "environment", "collect", "preflight", "gemm_probe", "tests_runtime",
                     "tests_kernels", "bench_decode", "bench_prefill", "bench_sampler", "bench_attention",
                     "sanitizer", "tests_regression", "bench_throughput", "results"]
    caps = [int(ln.split()[1]) for ln in lines[:-1]]
    assert lines[-1] == f"total {sum(caps)} s" and sum(caps) <= 480
    assert all(c > 0 for c in caps)
    # every step the kit records is one the results read (a renamed step would silently vanish from them)
    assert set(gpu_kit.BENCH_STEPS) | {n for n, _ in gpu_kit.TEST_STEPS} | {gpu_kit.REGRESSION_STEP} <= set(steps)


# -- the real run with a stand-in CuPy ---------------------------------------------------------------------------

FAKE_CUPY = '''
"""A stand-in CuPy for the script's preflight: numpy arrays, one device for the first process only
(the marker file), so the preflight passes and every later process - the GPU tests - sees none."""
import os, numpy as np
MARKER = os.environ["FAKE_CUPY_MARKER"]
__version__ = "14.2.0-fake"
float16, float32 = np.float16, np.float32

class _A(np.ndarray):
    def get(self):
        return np.asarray(self)

def arange(n, dtype=None): return np.arange(n, dtype=dtype).view(_A)
def asarray(a, dtype=None): return np.asarray(a, dtype=dtype).view(_A)

class RawKernel:
    def __init__(self, code, name):
        if os.environ.get("FAKE_NVRTC_BROKEN"):
            raise RuntimeError("libnvrtc.so.13: cannot open shared object file")
    def __call__(self, grid, block, args):
        x = args[0]
        x *= 2

class _Runtime:
    @staticmethod
    def getDeviceCount():
        if os.path.exists(MARKER):
            return 0
        open(MARKER, "w").close()
        return 1
    getDeviceProperties = staticmethod(lambda i: {"name": b"Fake H200"})
    runtimeGetVersion = staticmethod(lambda: 13000)
    driverGetVersion = staticmethod(lambda: 13000)

class _Device:
    compute_capability = "90"

class cuda:
    runtime = _Runtime
    Device = _Device

class random:
    @staticmethod
    def rand(n, dtype=None):
        return np.random.default_rng(0).random(n).astype(dtype).view(_A)
'''

FAKE_NVRTC = "def getVersion():\n    return (13, 0)\n"


def _fake_cupy_env(tmp_path: Path, **extra) -> dict:
    site = tmp_path / "site"
    (site / "cupy_backends" / "cuda" / "libs").mkdir(parents=True)
    (site / "cupy.py").write_text(FAKE_CUPY)
    for d in ("cupy_backends", "cupy_backends/cuda", "cupy_backends/cuda/libs"):
        (site / d / "__init__.py").write_text("")
    (site / "cupy_backends" / "cuda" / "libs" / "nvrtc.py").write_text(FAKE_NVRTC)
    return _real_run_env(tmp_path, PYTHONPATH=str(site), FAKE_CUPY_MARKER=str(tmp_path / "marker"), **extra)


@pytest.mark.slow
@needs_bash
@without_cupy
def test_gpu_tests_that_skip_on_the_gpu_machine_fail_the_run(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT)], env=_fake_cupy_env(tmp_path), capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "GPU tests SKIPPED" in proc.stderr
    out = tmp_path / "out"
    result = json.loads((out / "gpu_results.json").read_text())
    assert result["preflight"]["nvrtc"].startswith("ok") and result["preflight"]["cublas"] == "ok"
    for step in ("tests_runtime", "tests_kernels", "tests_regression"):
        tests = result[step]
        assert tests["skipped"] > 0 and tests["skipped"] == tests["collected"], step
        assert all("needs a GPU" in t["message"] for t in tests["skipped_tests"])
        assert (out / f"gpu_{step}.xml").exists() and "SKIPPED" in (out / f"gpu_{step}.log").read_text()
    # the benchmarks fail with the stand-in CuPy: named, not silently dropped
    assert result["bench_attention"]["ok"] is False and any("bench_attention" in f for f in result["failures"])
    # the steps ran in the plan's order, each with its record on disk
    order = [ln.split()[0] for ln in (out / "steps" / "steps.txt").read_text().splitlines()]
    assert order == ["install", "environment", "collect", "preflight", "gemm_probe", "tests_runtime",
                     "tests_kernels", "bench_decode", "bench_prefill", "bench_sampler", "bench_attention",
                     "sanitizer", "tests_regression", "bench_throughput"], order


@needs_bash
@without_cupy
def test_a_cuda_library_that_does_not_load_fails_the_preflight(tmp_path):
    env = _fake_cupy_env(tmp_path, FAKE_NVRTC_BROKEN="1")
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "CUDA libraries did not all load" in proc.stderr and "libnvrtc" in proc.stderr
    result = json.loads((tmp_path / "out" / "gpu_results.json").read_text())
    assert result["preflight"]["nvrtc"].startswith("FAILED") and result["preflight"]["curand"] == "ok"
    assert result["exit_code"] == 4


# -- the precompile and the sanitizer steps -------------------------------------------------------------------------

def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_model_compiles_only_its_own_attention_modules():
    pre = _script("gpu_precompile")
    f16 = pre.module_names(["f16"], [128])
    assert f16[:2] == ["paged_attention_f16_d128", "prefill_attention_f16_d128"]
    assert not any("bf16" in n or "d256" in n or "d64" in n for n in f16)
    # the elementwise families, and the LoRA shrink/expand module a server with --enable-lora loads
    assert {"cache_ops", "norm", "rotary", "activation", "embedding", "sampling", "lora"} <= set(f16) and len(f16) == 9
    rest = pre.module_names(["f16", "bf16"], [64, 128, 256], ["f16:128", "f16:64"])
    assert not set(rest) & set(f16 + pre.module_names(["f16"], [64]))
    # the two runs cover every module but the kv_cache_dtype ones (a bfloat16 pool's: compiled on first use)
    every = {m for m in cuda_modules.MODULES if "_kv_" not in m}
    assert set(rest) | set(f16) | set(pre.module_names(["f16"], [64])) == every
    with pytest.raises(ValueError, match="dtype/head_dim"):
        cuda_modules.model_modules("f16", 96)


def test_the_sanitizer_step_reads_its_tools_and_skips_without_compute_sanitizer(monkeypatch):
    san = _script("gpu_sanitize")
    race = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n1 passed in 3.1s\n"
    assert san.read_run("racecheck", "prefill", 0, race, 4.0)["state"] == "clean"
    hazard = race.replace("0 hazards", "3 hazards")
    assert san.read_run("racecheck", "prefill", san.ERROR_EXIT, hazard, 4.0)["state"] == "found problems"
    mem = "========= ERROR SUMMARY: 2 errors\n1 failed in 2.0s\n"
    assert san.read_run("memcheck", "paged_decode", san.ERROR_EXIT, mem, 4.0)["state"] == "found problems"
    assert san.read_run("memcheck", "prefill", 0, "1 skipped in 0.5s\n", 1.0)["state"] == "the case failed"
    assert san.read_run("memcheck", "prefill", None, "", 9.0)["state"] == "timed out"
    monkeypatch.setattr(san, "find_sanitizer", lambda: None)
    result = san.run(30)
    assert "compute-sanitizer is not on this image" in result["skipped"] and result.get("ok", True)


@needs_bash
def test_prepare_names_what_it_misses_when_pagedserve_is_not_importable(tmp_path):
    """A python without pagedserve (here: one whose sys.path cannot reach it) fails --prepare before any download,
    naming the missing module and the fix."""
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")  # isolated: no site-packages, no venv
    fake.chmod(0o755)
    env = {**os.environ, "GPU_CHECK_HOST_PYTHON": str(fake), "GPU_CHECK_DIR": str(tmp_path / "kit")}
    proc = subprocess.run(["bash", str(SCRIPT), "--prepare"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5, proc.stderr
    assert "cannot import them: ModuleNotFoundError: No module named" in proc.stderr
    assert ".venv/bin/pip install -e '.[test]'" in proc.stderr and not (tmp_path / "kit").exists()
