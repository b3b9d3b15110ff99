"""Fuzzing as a habit: schemathesis generates requests for every operation in the server's own
OpenAPI document (/schema/openapi.json) and checks that none gets a 500 and every response fits
the documented schema (errors included). Bounded: a fixed seed, a few hundred cases in all, and
generation capped at a few tokens so the run stays well under two minutes on two cores."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as fixed_seed
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import MODEL

EXAMPLES_PER_OPERATION = 15
# Fuzzed bodies keep their shape but are made cheap to answer: the served model (else nearly all
# are 404s that never reach validation), and at most a few tokens and choices.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}
DEFAULT_BUDGET = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens", "/responses": "max_output_tokens"}


def cheap(case) -> None:  # noqa: ANN001 - a schemathesis Case
    body = case.body
    if isinstance(body, dict) and "model" in body:
        body["model"] = MODEL
        for key, cap in CAPS.items():
            if type(body.get(key)) is int and body[key] > cap:
                body[key] = cap
        budget = DEFAULT_BUDGET.get(case.operation.path)
        if budget and body.get(budget) is None:
            body[budget] = CAPS[budget]


def test_no_operation_answers_500_or_off_its_schema(server):
    loaded = schemathesis.openapi.from_url(server.base_url + "/schema/openapi.json")
    operations = [result.ok() for result in loaded.get_all_operations()]
    assert len(operations) >= 15  # every route is in the document
    cases = 0
    for operation in operations:

        @fixed_seed(13)
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
            database=None,
            print_blob=True,
        )
        @given(case=operation.as_strategy())
        def fuzz(case) -> None:  # noqa: ANN001
            nonlocal cases
            cases += 1
            cheap(case)
            case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)

        fuzz()
    print(f"fuzzed {len(operations)} operations with {cases} cases")
