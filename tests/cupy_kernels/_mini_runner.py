"""Run pytest-style test functions where pytest is not installed (the bare GPU machine).

    python tests/cupy_kernels/_mini_runner.py tests/cupy_kernels/test_cuda_ops.py [--json out.json] [-k text]

If `import pytest` fails, a stand-in module with the little the GPU tests use is installed first:
pytest.mark.<name> (marks are recorded, `gpu` is required to run), pytest.mark.parametrize (stacked,
argument names as a comma-separated string or a list), pytest.raises (with match=), pytest.skip.
Every `test_*` function marked `gpu` is expanded over its parametrizations and run; the exit status
is 1 if any failed. Fixtures are not supported (the GPU tests take none).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import sys
import time
import traceback
import types
from pathlib import Path


class Skipped(Exception):
    pass


class _Mark:
    def __init__(self, name: str, args=(), kwargs=None):
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and self.name != "parametrize":
            fn = args[0]
            fn.__dict__.setdefault("_marks", []).append(_Mark(self.name))
            return fn
        mark = _Mark(self.name, args, kwargs)

        def decorate(fn):
            fn.__dict__.setdefault("_marks", []).append(mark)
            return fn

        return decorate


class _MarkFactory:
    def __getattr__(self, name: str) -> _Mark:
        return _Mark(name)


class _Raises:
    def __init__(self, exc, match=None):
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(exc_type, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(exc)):
            raise AssertionError(f"{exc!r} does not match {self.match!r}")
        return True


def install_pytest_stand_in() -> None:
    module = types.ModuleType("pytest")
    module.mark = _MarkFactory()
    module.raises = lambda exc, match=None: _Raises(exc, match)

    def skip(reason=""):
        raise Skipped(reason)

    module.skip = skip
    module.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda fn: fn))
    sys.modules["pytest"] = module


def _cases(fn):
    """(id, kwargs) for every combination of the function's parametrize marks."""
    axes = []
    for mark in fn.__dict__.get("_marks", []):
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0], mark.args[1]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        ids = mark.kwargs.get("ids")
        rows = []
        for i, v in enumerate(values):
            v = v if len(names) > 1 else (v,)
            label = ids[i] if ids else "-".join(getattr(x, "__name__", str(x)) for x in v)
            rows.append((label, dict(zip(names, v))))
        axes.append(rows)
    if not axes:
        return [("", {})]
    out = []
    for combo in itertools.product(*reversed(axes)):  # pytest lists the innermost decorator first
        out.append(("-".join(label for label, _ in combo), {k: v for _, kw in combo for k, v in kw.items()}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+")
    parser.add_argument("--json", help="write a summary here")
    parser.add_argument("-k", default="", help="run only tests whose id contains this text")
    args = parser.parse_args()
    try:
        import pytest  # noqa: F401
    except ImportError:
        install_pytest_stand_in()
    results = {"runner": "mini", "passed": 0, "failed": 0, "skipped": 0, "failures": [], "seconds": 0.0}
    t0 = time.perf_counter()
    for path in args.files:
        spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not callable(fn):
                continue
            if "gpu" not in {m.name for m in fn.__dict__.get("_marks", [])}:
                continue
            for label, kwargs in _cases(fn):
                test_id = f"{Path(path).name}::{name}" + (f"[{label}]" if label else "")
                if args.k and args.k not in test_id:
                    continue
                start = time.perf_counter()
                try:
                    fn(**kwargs)
                except Skipped as e:
                    results["skipped"] += 1
                    print(f"SKIP {test_id}: {e}", flush=True)
                    continue
                except Exception:  # noqa: BLE001 - report every failure and go on
                    results["failed"] += 1
                    tb = traceback.format_exc()
                    results["failures"].append({"test": test_id, "traceback": tb[-4000:]})
                    print(f"FAIL {test_id}\n{tb}", flush=True)
                    continue
                results["passed"] += 1
                print(f"ok   {test_id} ({time.perf_counter() - start:.1f}s)", flush=True)
    results["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{results['passed']} passed, {results['failed']} failed, {results['skipped']} skipped "
          f"in {results['seconds']}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
