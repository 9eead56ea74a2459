"""A pytest plugin for scripts/gpu_check.sh: every collected test, every start and every report, appended to
$GPU_TEST_RECORD as one JSON line each and flushed at once, so that a run killed by its time budget still
says which tests failed (with their messages), which was running, and which never started.

    PYTHONPATH=scripts pytest -p gpu_pytest_record ...     (GPU_TEST_RECORD=path/to/tests.jsonl)

A SIGTERM (what `timeout` sends first) becomes a KeyboardInterrupt, so pytest still writes its summary
and JUnit file; a test stuck inside a CUDA call only sees it when the call returns, and then `timeout -k`
kills the process - the lines written so far are what is left, and all that is needed.
"""

from __future__ import annotations

import json
import os
import signal
import time

_PATH = os.environ.get("GPU_TEST_RECORD")


def _write(rec: dict) -> None:
    if not _PATH:
        return
    rec["t"] = round(time.time(), 3)
    with open(_PATH, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _on_term(signum, frame):  # noqa: ARG001
    _write({"event": "interrupted", "why": "SIGTERM: the GPU tests' time budget ran out"})
    raise KeyboardInterrupt("SIGTERM: the GPU tests' time budget ran out")


def pytest_configure(config):  # noqa: ARG001
    if _PATH:
        signal.signal(signal.SIGTERM, _on_term)


def pytest_collection_finish(session):
    _write({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    rec = {"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "duration": round(report.duration, 3)}
    if report.outcome == "skipped":
        lr = report.longrepr
        rec["message"] = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    elif report.outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        text = report.longreprtext or ""
        rec["message"] = crash.message if crash is not None else (text.strip().splitlines() or [""])[-1]
        rec["detail"] = "\n".join(text.splitlines()[-60:])[-6000:]
    _write(rec)
