"""Fuzzing as a habit: schemathesis generates requests for every operation in the server's own
OpenAPI document (/schema/openapi.json: chat, completions, Responses, Messages, tokenize, models,
the operator routes) and checks that none gets a 500 and every response fits the documented schema
(errors included). A stateful phase then creates, continues (``previous_response_id``), reads and
deletes stored responses in random orders, with fuzzed bodies mixed in. Bounded: fixed seeds, a few
hundred cases in all, and generation capped at a few tokens so the run stays near two minutes on
two cores."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as fixed_seed
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, multiple, rule, run_state_machine_as_test
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from tests.conftest import MODEL

EXAMPLES_PER_OPERATION = 15
# Fuzzed bodies keep their shape but are made cheap to answer: the served model (else nearly all
# are 404s that never reach validation), and at most a few tokens and choices.
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "max_output_tokens": 4, "n": 2, "best_of": 2}
DEFAULT_BUDGET = {
    "/v1/chat/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
    "/responses": "max_output_tokens",
}


def cheap(case) -> None:  # a schemathesis Case
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
        def fuzz(case) -> None:
            nonlocal cases
            cases += 1
            cheap(case)
            case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)

        fuzz()
    print(f"fuzzed {len(operations)} operations with {cases} cases")


TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
RESPONSE_TOOL = {
    "type": "function",
    "name": "lookup",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}


def created_body(previous: str | None = None) -> st.SearchStrategy[dict]:
    """A Responses body that is mostly valid (so responses get stored and continued), with fuzzed
    values where a client could put anything."""
    items = st.lists(
        st.one_of(
            st.builds(lambda t: {"type": "message", "role": "user", "content": t}, TEXT),
            st.builds(lambda t: {"role": "user", "content": [{"type": "input_text", "text": t}]}, TEXT),
        ),
        min_size=1,
        max_size=3,
    )
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "x"}'}
    items = items | st.builds(
        lambda t: [call, {"type": "function_call_output", "call_id": "call_1", "output": t}], TEXT
    )
    return st.fixed_dictionaries(
        {"model": st.just(MODEL), "input": st.one_of(TEXT, items), "max_output_tokens": st.integers(1, 4)},
        optional={
            "instructions": TEXT,
            "store": st.booleans(),
            "temperature": st.floats(0, 2),
            "tools": st.just([RESPONSE_TOOL]),
            "tool_choice": st.sampled_from(["auto", "none", "required"]),
            **({"previous_response_id": st.just(previous)} if previous else {}),
        },
    )


def test_responses_are_created_continued_read_and_deleted_statefully(server):
    """No 5xx, and every answer fits the schema, whatever order clients create, continue, read and
    delete stored responses in: a stored response can be read and continued until it is deleted, then
    reading it is a 404."""
    loaded = schemathesis.openapi.from_url(server.base_url + "/schema/openapi.json")
    create, read, remove = (
        loaded[path][method]
        for path, method in (
            ("/v1/responses", "POST"),
            ("/v1/responses/{response_id}", "GET"),
            ("/v1/responses/{response_id}", "DELETE"),
        )
    )
    statuses: dict[str, list[int]] = {"create": [], "continue": [], "read": [], "delete": []}

    def call(operation, kind: str, **parts):  # schemathesis objects
        response = operation.Case(**parts).call_and_validate(
            checks=[not_a_server_error, response_schema_conformance], timeout=60
        )
        statuses[kind].append(response.status_code)
        return response

    class Responses(RuleBasedStateMachine):
        stored = Bundle("stored")

        @rule(target=stored, data=st.data())
        def create(self, data):
            body = data.draw(st.one_of(created_body(), create.as_strategy().map(lambda case: case.body)))
            if isinstance(body, dict):
                body = {**body, "model": MODEL, "max_output_tokens": 4, "stream": False}
            response = call(create, "create", body=body)
            ok = response.status_code == 200 and isinstance(body, dict) and body.get("store", True)
            return response.json()["id"] if ok else multiple()

        @rule(target=stored, previous=stored, data=st.data())
        def continue_(self, previous, data):
            body = {**data.draw(created_body(previous)), "previous_response_id": previous, "stream": False}
            response = call(create, "continue", body=body)
            assert response.status_code == 200 or response.json()["error"]["param"] != "previous_response_id", (
                response.text
            )
            return response.json()["id"] if response.status_code == 200 and body.get("store", True) else multiple()

        @rule(response_id=stored)
        def read(self, response_id):
            assert call(read, "read", path_parameters={"response_id": response_id}).status_code == 200

        @rule(response_id=consumes(stored))
        def delete(self, response_id):
            assert call(remove, "delete", path_parameters={"response_id": response_id}).status_code == 200
            assert call(read, "read", path_parameters={"response_id": response_id}).status_code == 404

    def reached() -> bool:  # the phase did reach its states
        return statuses["continue"].count(200) >= 3 and statuses["delete"].count(200) >= 3

    # The fixed walk follows the server's answers (a refused body stores nothing to go on from), so
    # after the suite's earlier traffic it can reach fewer states: then a walk of its own goes on.
    for derandomize, examples in ((True, 12), (False, 24)):
        run_state_machine_as_test(
            Responses,
            settings=settings(
                max_examples=examples,
                stateful_step_count=8,
                deadline=None,
                derandomize=derandomize,
                suppress_health_check=list(HealthCheck),
                database=None,
            ),
        )
        if reached():
            break
    print({kind: len(codes) for kind, codes in statuses.items()})
    assert reached(), statuses
