"""Without Ray installed, asking for the Ray executor is a clear error naming the extra that brings it.

Ray is hidden from a child process by a meta path finder (so this runs whether or not Ray is installed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from server_proc import TINY

HIDE_RAY = textwrap.dedent("""
    import sys

    class HideRay:
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, HideRay())
""")

OFFLINE = HIDE_RAY + textwrap.dedent(f"""
    from pagedserve.runtime import LLM
    try:
        LLM({TINY!r}, device="cpu", num_kv_blocks=64, tensor_parallel_size=2, distributed_executor_backend="ray")
    except ValueError as e:
        print("ValueError:", e)
""")

SERVE = HIDE_RAY + textwrap.dedent("""
    from pagedserve.sidecar.cli import main
    sys.exit(main(sys.argv[1:]))
""")

MESSAGE = "distributed_executor_backend='ray' needs Ray: pip install 'pagedserve[ray]'"


def test_llm_without_ray_says_which_extra_to_install():
    out = subprocess.run([sys.executable, "-c", OFFLINE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"ValueError: {MESSAGE}" in out.stdout, out.stdout + out.stderr


def test_serve_without_ray_exits_2_with_one_line_naming_the_extra(tmp_path):
    args = ["serve", "--socket", str(tmp_path / "ps.sock"), "--device", "cpu", "--model", TINY,
            "--tensor-parallel-size", "2", "--distributed-executor", "ray"]
    out = subprocess.run([sys.executable, "-c", SERVE, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"pagedserve: error: {MESSAGE}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
