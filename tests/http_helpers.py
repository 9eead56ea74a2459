"""Helpers shared by the HTTP API's tests (tests/sidecar/test_http_*.py)."""

from __future__ import annotations

import functools
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import jsonschema
import openai
from server_proc import ServerProcess, client_for


def http_address(srv: ServerProcess) -> str:
    """The HTTP API's address, from the server's `server.listening` log line (port 0: the kernel chose it)."""
    for line in srv.log().splitlines():
        if '"server.listening"' in line:
            return next(a for a in json.loads(line)["addresses"] if a.startswith("http://"))
    raise AssertionError(f"no server.listening line:\n{srv.log()}")


def grpc_greedy_ids(server: ServerProcess, prompt: list[int], n: int) -> list[int]:
    with client_for(server) as c:
        return [t for ch in c.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True) for t in ch.token_ids]


# -- the bodies the HTTP tests send, checked against the server's OpenAPI document ---------------------------
# Every body a test sends through `recording_openai` or `send` is kept in SENT with its answer's status and
# error param; tests/sidecar/conftest.py checks each test's bodies against the document at its end
# (check_sent): a body the server took must be one the document accepts; one it refused with a 400 must be
# refused by the document too, or name (error.param) a field the operation lists under x-checked-by-server
# for its value (error.code not invalid_type: the document has the types).

@dataclass
class Sent:
    path: str
    body: Any
    status: int
    param: str | None = None
    code: str | None = None


SENT: list[Sent] = []


def _record(path: str, data: bytes | None, status: int, answer: bytes | None) -> None:
    try:
        body = json.loads(data) if data else None
    except ValueError:
        return  # not JSON: nothing the document speaks of
    error: dict = {}
    if status >= 400 and answer:
        try:
            error = json.loads(answer).get("error", {})
        except (ValueError, AttributeError):
            pass
    SENT.append(Sent(path, body, status, error.get("param"), error.get("code")))


def recording_openai(base_url: str, api_key: str = "unused", **kw) -> openai.OpenAI:
    """The official client, its requests' bodies kept in SENT."""
    def hook(response) -> None:
        answer = response.read() if response.status_code >= 400 else None
        _record(response.request.url.path, response.request.content, response.status_code, answer)
    http = openai.DefaultHttpxClient(event_hooks={"response": [hook]})
    return openai.OpenAI(base_url=base_url, api_key=api_key, http_client=http, **kw)


def send(url: str, body: Any = None, raw: bytes | None = None, method: str = "POST",
         headers: dict | None = None) -> tuple[int, dict]:
    """One JSON request with urllib (raw: bytes sent as they are), its body kept in SENT."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, answer = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, answer = e.code, e.read()
    if method == "POST":
        _record(urllib.parse.urlsplit(url).path, data, status, answer)
    return status, json.loads(answer)


@functools.cache
def openapi_document() -> dict:
    """The document the server serves, built in-process from the same code (no engine needed)."""
    from pagedserve.sidecar.http_api import HttpApi

    return HttpApi(lambda: None, lambda: "m", lambda: True, 100, 4).app("key").app.app.openapi()


def resolve(schema: Any, doc: dict) -> Any:
    """The schema with every $ref into the document's components inlined (the models are not recursive)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            name = schema["$ref"].removeprefix("#/components/schemas/")
            return resolve(doc["components"]["schemas"][name], doc)
        return {k: resolve(v, doc) for k, v in schema.items() if k != "discriminator"}  # OpenAPI's own keyword
    if isinstance(schema, list):
        return [resolve(v, doc) for v in schema]
    return schema


def body_schema(doc: dict, path: str) -> dict | None:
    """The resolved JSON Schema of a POST route's body, or None for a route without one."""
    op = doc["paths"].get(path, {}).get("post")
    if op is None or "requestBody" not in op:
        return None
    return resolve(op["requestBody"]["content"]["application/json"]["schema"], doc)


def check_sent(sent: list[Sent], doc: dict | None = None) -> list[str]:
    """What in `sent` disagrees with the document (see SENT)."""
    doc = doc or openapi_document()
    problems = []
    for s in sent:
        schema = body_schema(doc, s.path)
        if schema is None or s.status in (401, 413):  # a body refused before it is read
            continue
        error = next(iter(jsonschema.Draft202012Validator(schema).iter_errors(s.body)), None)
        if s.status != 400:
            if error is not None:
                problems.append(f"{s.path} answered {s.status}, but the document refuses "
                                f"{json.dumps(s.body)[:300]}: {error.message[:300]}")
            continue
        checked = doc["paths"][s.path]["post"].get("x-checked-by-server", [])
        root = re.split(r"[.\[]", s.param or "", maxsplit=1)[0]
        if error is None and (root not in checked or s.code == "invalid_type"):
            problems.append(f"{s.path} answered 400 ({s.code} {s.param!r}), but the document accepts "
                            f"{json.dumps(s.body)[:300]}" + ("" if s.code == "invalid_type" else
                                                          f" and lists no server check of {root!r}"))
    return problems
