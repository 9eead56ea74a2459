"""kernel_set's compile thread: the first half of the numba warm-up runs beside the model's load, and what it
raises reaches the caller that waits for the kernels."""

from __future__ import annotations

import threading

import pytest

from pagedserve.cupy_kernels.kernel_set import _CompileThread


def test_the_thread_runs_its_work_beside_the_caller_and_join_waits_for_it():
    started, release, done = threading.Event(), threading.Event(), []

    def work():
        started.set()
        assert release.wait(30)
        done.append(True)

    thread = _CompileThread(work)
    thread.start()
    assert started.wait(30) and not done  # the caller goes on (the worker loads the model) while it runs
    release.set()
    thread.join()
    assert done == [True] and not thread.is_alive() and not thread.daemon


def test_an_error_in_the_thread_is_raised_by_join_once():
    thread = _CompileThread(lambda: (_ for _ in ()).throw(RuntimeError("LLVM failed")))
    thread.start()
    with pytest.raises(RuntimeError, match="LLVM failed"):
        thread.join()
    thread.join()  # already reported: a second wait returns
