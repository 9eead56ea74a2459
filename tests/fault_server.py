"""`pagedserve serve` with faults injected by request id, for the sidecar fault tests (run as a script).

    fail-*        its update stage raises after its second token: that request alone fails (INTERNAL)
    kill-worker   the engine's worker thread dies when it picks the request up
"""

from __future__ import annotations

import sys

from pagedserve.runtime.engine import async_engine, output_processor


def _inject() -> None:
    append_tokens = output_processor.OutputProcessor.append_tokens

    def failing_append(self, r, toks):
        if r.request_id.startswith("fail-") and r.num_output_tokens >= 2:
            raise RuntimeError("injected fault in the update stage")
        return append_tokens(self, r, toks)

    drain_commands = async_engine.AsyncEngine._drain_commands

    def dying_drain(self):
        with self._lock:
            doomed = any(kind == "add" and payload.request_id == "kill-worker" for kind, payload in self._commands)
        if doomed:
            raise SystemError("injected: the engine worker dies")
        drain_commands(self)

    output_processor.OutputProcessor.append_tokens = failing_append
    async_engine.AsyncEngine._drain_commands = dying_drain


if __name__ == "__main__":
    _inject()
    from pagedserve.sidecar.cli import main

    sys.exit(main(sys.argv[1:]))
