"""Every HTTP test's request bodies are checked against the server's OpenAPI document when it ends
(tests/http_helpers.py: SENT, check_sent)."""

from __future__ import annotations

import pytest
from http_helpers import SENT, check_sent


@pytest.fixture(autouse=True)
def _bodies_match_the_openapi_document():
    start = len(SENT)
    yield
    problems = check_sent(SENT[start:])
    assert not problems, "\n".join(problems)
