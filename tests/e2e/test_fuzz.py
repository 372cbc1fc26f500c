"""Property-based: whatever a client sends to any endpoint of the published schema, the
answer is never a 5xx, and every error is in OpenAI's envelope. Schemathesis generates the
requests from /openapi.json (valid and invalid bodies alike) against a live server; the
hypothesis settings make the run repeatable (derandomized, no example database)."""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.e2e.conftest import API_KEY, start_server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def fuzz_server(tiny_path, tmp_path_factory):
    """A small context window bounds the work of any request (n <= 128 times 64 tokens)."""
    server = start_server(tiny_path, tmp_path_factory.mktemp("fuzz"), "--api-key", API_KEY,
                          "--max-model-len", "64", "--request-timeout", "30", name="fuzz")
    yield server
    assert server.stop() == 0


def _property(cases, seen: Counter):
    """The property, over the cases of one operation: no 5xx, errors in the envelope."""

    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case) -> None:
        response = case.call(headers=AUTH, timeout=60)
        seen[response.status_code] += 1
        assert response.status_code < 500, (
            f"{case.method} {case.path} -> {response.status_code}: "
            f"{response.text[:300]}; body: {case.body!r}"[:1500])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    return check


def _nothing_to_break(operation) -> bool:
    """No body, and no parameter but free-form strings in the path (GET /health, POST
    /reset_prefix_cache, GET /v1/models/{model_id}): negative mode has nothing it could
    make invalid (in a URL path, anything is a string)."""
    def free_path_string(p) -> bool:
        schema = {k: v for k, v in p.definition.get("schema", {}).items() if k != "title"}
        return p.definition.get("in") == "path" and schema == {"type": "string"}

    return not list(operation.body) and all(map(free_path_string, operation.iter_parameters()))


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_request_gets_a_server_error(fuzz_server, mode):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/tokenize", "/detokenize"}
    statuses: dict[str, Counter] = {}
    for operation in operations:
        seen = statuses.setdefault(f"{operation.method.upper()} {operation.path}", Counter())

        check = _property(operation.as_strategy(generation_mode=mode), seen)
        try:
            check()
        except Unsatisfiable:  # negative mode: nothing to break in this call's input
            assert mode is GenerationMode.NEGATIVE and _nothing_to_break(operation), operation.label
    # The generated requests reached the engine (positive) and the validators (negative).
    # Few valid-by-schema bodies fit a 64-token context and name the served model (2 to 12
    # of 40 per endpoint in runs here, 0 once for completions): counted over both.
    completions, chat = statuses["POST /v1/completions"], statuses["POST /v1/chat/completions"]
    if mode is GenerationMode.POSITIVE:
        assert completions[200] + chat[200] > 0, statuses
    else:
        assert completions[400] > 0 and chat[400] > 0, statuses
