"""The model's tool calls out of a reply's text, whole or as it streams, as OpenAI's tool_calls.

Shapes are OpenAI's: a call is {"id": "call_<24 hex>", "type": "function", "function": {"name": str,
"arguments": <JSON text>}}; stream deltas are {"content": str}, then for each call
{"tool_calls": [{"index": i, "id", "type": "function", "function": {"name", "arguments": ""}}]} followed by
{"tool_calls": [{"index": i, "function": {"arguments": <fragment>}}]}. Joining the deltas of any split of a
text gives parse(text) (ids aside).

What the parser finds: the Hermes/Qwen format (what templates without a tools branch are prompted with, Qwen's
own templates use, and the grammar forces) and the formats of the other families' own tools branches:

    Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>   -> content "Sure.", call f {"x": 1}
    {"name": "f", "parameters": {"x": 1}}                -> a bare object at the start or after a call (Llama 3)
    [{"name": "f", "arguments": {...}}, {...}]           -> a list of them at the start (Mistral)
    <tool_call>{"arguments": {...}, "name": "f"}          -> any key order, arguments as a JSON string, an
                                                             unclosed tag at the end: decoded when it closes
    <tool_call>not json</tool_call>, an unknown name     -> left in content as written

Streaming holds back only what could still become a call: a suffix that may start `<tool_call>`, trailing
whitespace (dropped before a call), a bare `{"name": ...` (or `[{"name": ...`) head until it is one, and an
uncommitted tag's inside. Once `"arguments": {` of a known name is seen, the call is announced and its
arguments stream as they come (a reply cut by max_tokens leaves them incomplete, as OpenAI's do; `ended_in_call`
then says so). With parallel_tool_calls false only the first call is kept.
"""

from __future__ import annotations

import json
import re
import secrets

TAG, END = "<tool_call>", "</tool_call>"
WS = " \t\n\r"


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# Parser states.
_TEXT, _TAG_HEAD, _TAG_BLOCK, _BARE_HEAD, _BARE_BLOCK, _ARGS, _AFTER = range(7)
_MORE, _NO, _YES = range(3)
_MAX_NAME_TEXT = 200
_STRING = re.compile(r'"(?:[^"\\\n]|\\.){0,%d}"' % _MAX_NAME_TEXT)
_STRING_ANY = re.compile(r'"(?:[^"\\]|\\.)*"')


def _match_head(buf: str) -> tuple[int, str | None, int]:
    """Does `buf` open a call `{"name": "<n>", "arguments": ` (or "parameters")?

    (_YES, name, index of the arguments' first character), (_MORE, None, 0) while it may still, or
    (_NO, None, 0) once it cannot.
    """
    i = 0
    for piece in ("{", '"name"', ":", None, ",", ('"arguments"', '"parameters"'), ":"):
        while i < len(buf) and buf[i] in WS:
            i += 1
        if i == len(buf):
            return _MORE, None, 0
        if piece is None:  # the name: a JSON string (a tool's name is short; a raw newline ends the hope)
            m = _STRING.match(buf, i)
            if m is None:
                rest = buf[i:]
                if rest[0] != '"' or len(rest) > _MAX_NAME_TEXT or "\n" in rest or _STRING_ANY.match(rest):
                    return _NO, None, 0
                return _MORE, None, 0
            try:
                name = json.loads(m.group(0))
            except ValueError:
                return _NO, None, 0
            i = m.end()
            continue
        options = piece if isinstance(piece, tuple) else (piece,)
        rest = buf[i:]
        hit = next((p for p in options if rest.startswith(p)), None)
        if hit is None:
            return (_MORE if any(p.startswith(rest) for p in options) else _NO), None, 0
        i += len(hit)
    while i < len(buf) and buf[i] in WS:
        i += 1
    return (_MORE, None, 0) if i == len(buf) else (_YES, name, i)


class _JsonEnd:
    """Finds where a JSON value that starts with `{` (or sits inside one: depth=1) ends, fed in pieces."""

    def __init__(self, depth: int = 0) -> None:
        self.depth, self.in_string, self.escape, self.started = depth, False, False, depth > 0

    def feed(self, text: str, stop_at_lt: bool = False) -> int:
        """The index in `text` just past the end of the value, -1 if it has not ended; with stop_at_lt,
        a `<` outside a string (a tag in broken JSON) ends it there, unconsumed."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
                self.started = True
            elif c in "}]":
                self.depth -= 1
                if self.started and self.depth <= 0:
                    return i + 1
            elif c == "<" and stop_at_lt:
                return i
        return -1


def _decode_call(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) when `text` is a whole call object of a known tool, else None."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # arguments already as JSON text, as OpenAI itself sends them
        try:
            return (obj["name"], args) if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _end_or_tag(buf: str) -> tuple[int, int]:
    """(index of the first `</tool_call>` or -1, index of a `<tool_call>` before it or -1)."""
    k, t = buf.find(END), buf.find(TAG)
    return k, (t if 0 <= t and (k < 0 or t < k) else -1)


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


class ToolCallParser:
    """Tool calls out of a reply's text, whole (`parse`) or as it streams (`feed` / `finish`); see the
    module docstring for what is recognised. One parser per choice; `parse` uses a fresh copy."""

    def __init__(self, names: tuple[str, ...] | list[str], max_calls: int | None = None) -> None:
        self.names = tuple(names)
        self._known = frozenset(names)
        self.max_calls = max_calls
        self._state = _TEXT
        self._buf = ""  # undecided text of the current state
        self._ws = ""  # whitespace held back in text (dropped before a call, else sent with what follows)
        self._eligible = True  # a bare call may start here: only whitespace since the start or the last call
        self._tagged = False  # the current call came inside <tool_call>
        self._scan: _JsonEnd | None = None
        self._scanned = 0  # characters of the buffer the scanner has seen (_BARE_BLOCK)
        self._list_open = ""  # "[" (and whitespace) of a bare list whose first call is not yet decided
        self._in_list = False  # inside a bare list of calls: "," and "]" between calls are not content
        self._emit = True  # the current call is reported (False past max_calls)
        self._content: list[str] = []
        self.tool_calls: list[dict] = []
        self._finished = False
        self.ended_in_call = False  # finish() found the text inside a call, or a call's marker, unclosed

    # -- public -------------------------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole reply: content None when the reply only called tools."""
        fresh = ToolCallParser(self.names, self.max_calls)
        fresh.feed(text)
        fresh.finish()
        self.ended_in_call = fresh.ended_in_call
        content = fresh.content
        return (None if fresh.tool_calls and not content else content), fresh.tool_calls

    def feed(self, delta: str) -> list[dict]:
        if self._finished:
            raise ValueError("ToolCallParser.feed after finish")
        out: list[dict] = []
        self._buf += delta
        self._run(out, final=False)
        return out

    def finish(self) -> list[dict]:
        if self._finished:
            return []
        out: list[dict] = []
        # inside a call's tag or arguments, or on a marker's first characters (all that may follow a call)
        self.ended_in_call = self._state != _TEXT or bool(self._buf) and TAG.startswith(self._buf)
        self._run(out, final=True)
        if self._ws and not self.tool_calls:  # whitespace ending a reply without calls is the reply's own
            self._send_content(self._ws, out)
        self._ws = ""
        self._finished = True
        return out

    @property
    def content(self) -> str:
        return "".join(self._content)

    # -- the machine --------------------------------------------------------------------------------------

    def _run(self, out: list[dict], final: bool) -> None:
        steps = 4 * len(self._buf) + 16  # every step that returns True consumes text or moves on a state
        for _ in range(steps):
            if not self._step(out, final):
                return
        raise AssertionError("ToolCallParser made no progress")  # an internal invariant, not bad input

    def _step(self, out: list[dict], final: bool) -> bool:
        buf, state = self._buf, self._state
        if state == _TEXT:
            if self._in_list:  # between the calls of a bare list: separators, then a call or the list's end
                rest = buf.lstrip(WS + ",")
                if not rest:
                    self._buf = ""
                    return False
                if rest[0] == "{":
                    self._buf, self._state, self._tagged = rest, _BARE_HEAD, False
                    return True
                self._in_list = False
                self._buf = rest[1:] if rest[0] == "]" else rest
                return True
            if self._eligible:
                j = len(buf) - len(buf.lstrip(WS))
                if j < len(buf) and buf[j] == "{":
                    self._text(buf[:j], out)
                    self._buf, self._state, self._tagged = buf[j:], _BARE_HEAD, False
                    return True
                if j < len(buf) and buf[j] == "[":  # a list of calls (Mistral's, after its [TOOL_CALLS] token)
                    k = len(buf) - len(buf[j + 1:].lstrip(WS))
                    if k == len(buf) and not final:
                        self._text(buf[:j], out)
                        self._buf = buf[j:]
                        return False
                    if k < len(buf) and buf[k] == "{":
                        self._text(buf[:j], out)
                        self._list_open = buf[j:k]
                        self._buf, self._state, self._tagged = buf[k:], _BARE_HEAD, False
                        return True
            i = buf.find(TAG)
            if i >= 0:
                self._text(buf[:i], out)
                self._buf, self._state, self._tagged = buf[i + len(TAG):], _TAG_HEAD, True
                return True
            keep = 0 if final else _partial_suffix(buf, TAG)
            self._text(buf[: len(buf) - keep], out)
            self._buf = buf[len(buf) - keep:]
            return False
        if state in (_TAG_HEAD, _BARE_HEAD):
            status, name, at = _match_head(buf)
            if status == _MORE and not final:
                return False
            if status == _YES and name in self._known and buf[at] == "{":
                self._open_call(name, out)
                self._buf, self._state, self._scan = buf[at:], _ARGS, _JsonEnd()
                return True
            if state == _TAG_HEAD:
                self._state = _TAG_BLOCK
            elif status == _YES and name in self._known and buf[at] == '"':  # arguments as a JSON string
                self._state, self._scan, self._scanned = _BARE_BLOCK, _JsonEnd(), 0
            else:  # not a call: the "{" is content, and the text after it is read again as text
                self._not_a_call(buf[:1], out, rest=buf[1:])
            return True
        if state == _TAG_BLOCK:
            k, t = _end_or_tag(buf)
            if t >= 0:  # a new tag before this one closed: this one was not a call
                self._not_a_call(TAG + buf[:t], out, rest=buf[t:])
                return True
            if k < 0 and not final:
                return False
            inner, rest = (buf[:k], buf[k + len(END):]) if k >= 0 else (buf, "")
            self._decide(inner.strip(WS), TAG + inner + (END if k >= 0 else ""), rest, out)
            return True
        if state == _BARE_BLOCK:
            n = self._scan.feed(buf[self._scanned:])  # the buffer waits whole; feed the scanner each char once
            n, self._scanned = (-1, len(buf)) if n < 0 else (n + self._scanned, self._scanned)
            if n < 0 and not final:
                return False
            whole, rest = (buf[:n], buf[n:]) if n >= 0 else (buf, "")
            self._decide(whole, whole, rest, out)
            return True
        if state == _ARGS:
            n = self._scan.feed(buf, stop_at_lt=self._tagged)
            piece, rest = (buf, "") if n < 0 else (buf[:n], buf[n:])
            self._send_arguments(piece, out)
            self._buf = rest
            if n < 0:
                return False
            # past the arguments: the rest of the call object (its "}", anything else) is not reported
            self._state, self._scan = _AFTER, (None if self._tagged else _JsonEnd(depth=1))
            return True
        # _AFTER: swallow the call's remains up to </tool_call> (tagged) or the object's "}" (bare)
        if not self._tagged:
            n = self._scan.feed(buf, stop_at_lt=True)
            if n < 0:
                self._buf = ""
                return False
            self._buf = buf[n:]
            self._close_call()
            return True
        k, t = _end_or_tag(buf)
        if t >= 0:
            self._buf = buf[t:]
        elif k >= 0:
            self._buf = buf[k + len(END):]
        else:
            keep = 0 if final else max(_partial_suffix(buf, END), _partial_suffix(buf, TAG))
            self._buf = buf[len(buf) - keep:]
            return False
        self._close_call()
        return True

    # -- what the states emit ----------------------------------------------------------------------------

    def _text(self, text: str, out: list[dict]) -> None:
        """Text known to be content; its trailing whitespace is held until more content follows."""
        stripped = text.rstrip(WS)
        if stripped:
            self._send_content(self._ws + stripped, out)
            self._eligible = False
            self._ws = text[len(stripped):]
        else:
            self._ws += text

    def _not_a_call(self, text: str, out: list[dict], rest: str = "") -> None:
        self._state, self._in_list = _TEXT, False
        self._text(self._list_open + text, out)  # a list whose first element is not a call is text too
        self._list_open = ""
        self._eligible = False
        self._buf = rest

    def _open_call(self, name: str, out: list[dict]) -> None:
        self._ws = ""  # whitespace before a call is not content
        self._in_list, self._list_open = bool(self._list_open) or self._in_list, ""
        self._emit = self.max_calls is None or len(self.tool_calls) < self.max_calls
        if self._emit:
            call_id = new_call_id()
            self.tool_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
            out.append({"tool_calls": [{"index": len(self.tool_calls) - 1, "id": call_id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})

    def _send_arguments(self, piece: str, out: list[dict]) -> None:
        if not piece or not self._emit:
            return
        index = len(self.tool_calls) - 1
        self.tool_calls[index]["function"]["arguments"] += piece
        last = out[-1]["tool_calls"][0] if out and "tool_calls" in out[-1] else None
        if last is not None and last["index"] == index and "id" not in last:
            last["function"]["arguments"] += piece
        else:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def _decide(self, text: str, as_written: str, rest: str, out: list[dict]) -> None:
        """A whole call when `text` decodes as one of a known tool, else `as_written` is content; then `rest`."""
        call = _decode_call(text, self._known)
        if call is None:
            self._not_a_call(as_written, out, rest=rest)
            return
        self._open_call(call[0], out)
        self._send_arguments(call[1], out)
        self._close_call()
        self._buf = rest

    def _close_call(self) -> None:
        self._state, self._scan, self._eligible, self._ws = _TEXT, None, True, ""

    def _send_content(self, text: str, out: list[dict]) -> None:
        self._content.append(text)
        if out and "content" in out[-1]:
            out[-1]["content"] += text
        else:
            out.append({"content": text})
