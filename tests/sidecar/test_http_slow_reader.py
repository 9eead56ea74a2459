"""An HTTP stream whose client stops reading: ended after slow_reader_timeout (sse-starlette's send_timeout), its
request aborted and its blocks freed while the client still holds the connection open, as on the gRPC path
(tests/sidecar/test_slow_reader.py)."""

from __future__ import annotations

import json
import socket

from engine_helpers import wait_until
from http_helpers import http_address
from server_proc import ServerProcess, client_for


def test_a_stalled_http_stream_is_cut_off_and_its_blocks_freed(tmp_path):
    srv = ServerProcess(tmp_path, "--slow-reader-timeout", "1", "--http-port", "0")
    srv.wait_serving()
    try:
        host, port = http_address(srv).removeprefix("http://").rsplit(":", 1)
        # Each token's chunk carries 20 top logprobs (~2 KB): 4 x 2000 of them (~16 MB) are far more than the
        # socket buffers and uvicorn's write buffer hold, so the server's sends block once this client stops reading.
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000, "temperature": 1.0,
                           "n": 4, "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        with s:
            s.connect((host, int(port)))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert s.recv(1024).startswith(b"HTTP/1.1 200")  # admitted and streaming; then nothing more is read
            with client_for(srv) as c:
                other = list(c.generate([9, 10, 11], max_tokens=64, temperature=0.0, ignore_eos=True))
                assert sum(len(ch.token_ids) for ch in other) == 64  # other streams carry on meanwhile

                def freed() -> bool:
                    st = c.server_stats()
                    log = srv.log()
                    return ('"request.aborted"' in log and '"http.slow_reader"' in log and st.kv_blocks_used == 0
                            and st.num_running == 0)
                wait_until(freed, 60, "the stalled request to be aborted and its blocks freed")
            finished = [json.loads(line) for line in srv.log().splitlines() if '"request.finished"' in line]
            assert not [e for e in finished if e["request_id"].startswith("chatcmpl-")], finished
            assert "Traceback" not in srv.log()  # one log line, not an ASGI traceback
    finally:
        assert srv.stop() == 0, srv.log()
