"""POST /v1/decisions on the shared server: probabilities that sum to 1 and agree with the greedy
answer chat gives under guided_choice over the same labels."""

from __future__ import annotations

import math

import pytest

from gateway.generate import decisions
from gateway.schemas.decisions import DecisionOption, DecisionQuestion, ScoreLevel
from tests.conftest import MODEL

TICKET = "I was charged twice for the same subscription renewal this month."
QUESTIONS = [
    DecisionQuestion(type="predicate", name="duplicate", instructions="The customer reports a duplicate charge."),
    DecisionQuestion(
        type="choice",
        name="category",
        instructions="Classify the support ticket.",
        choices=[
            DecisionOption(value="billing"),
            DecisionOption(value="technical", description="outages"),
            DecisionOption(value=True),
        ],
    ),
    DecisionQuestion(
        type="score",
        name="urgency",
        instructions="How urgent is the ticket?",
        levels=[ScoreLevel(label="low"), ScoreLevel(label="medium"), ScoreLevel(label="high")],
    ),
]


def _wire(question: DecisionQuestion) -> dict:
    body = {"type": question.type, "name": question.name, "instructions": question.instructions}
    if question.choices:
        body["choices"] = [
            {"value": c.value, **({"description": c.description} if c.description else {})} for c in question.choices
        ]
    if question.levels:
        body["levels"] = [{"label": level.label} for level in question.levels]
    return body


def test_decisions_sum_to_one_and_agree_with_guided_choice(server, client):
    response = server.post(
        "/v1/decisions", json={"model": MODEL, "input": TICKET, "questions": [_wire(q) for q in QUESTIONS]}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == MODEL and body["usage"]["input_tokens"] > 0
    predicate, choice, score = body["answers"]
    assert [a["name"] for a in body["answers"]] == ["duplicate", "category", "urgency"]
    assert 0 <= predicate["probability"] <= 1
    for answer in (choice, score):
        assert math.isclose(sum(p["probability"] for p in answer["probabilities"]), 1, abs_tol=1e-6)
    assert choice["choice"] in ("billing", "technical", True)
    assert [p["value"] for p in choice["probabilities"]] == ["billing", "technical", True]
    assert score["score"] == pytest.approx(sum(p["value"] * p["probability"] for p in score["probabilities"]))

    # Each most probable label is the greedy answer under guided_choice over the same labels.
    for question, answer in zip(QUESTIONS, body["answers"]):
        item = decisions.asked(question, 0)
        greedy = (
            client.chat.completions.create(
                model=MODEL,
                messages=decisions.messages(TICKET, item),
                temperature=0,
                max_tokens=2,
                extra_body={"guided_choice": item.labels},
            )
            .choices[0]
            .message.content
        )
        probs = (
            [answer["probability"], 1 - answer["probability"]]
            if question.type == "predicate"
            else [p["probability"] for p in answer["probabilities"]]
        )
        assert greedy == item.labels[probs.index(max(probs))]


def test_decisions_refuse_bad_questions_naming_the_field(server):
    def ask(questions: list, given: object = TICKET) -> dict:
        response = server.post("/v1/decisions", json={"model": MODEL, "input": given, "questions": questions})
        assert response.status_code == 400
        return response.json()["error"]

    assert (
        ask([{"type": "choice", "instructions": "x", "choices": [{"value": "a"}]}])["param"] == "questions[0].choices"
    )
    assert ask([{"type": "guess", "instructions": "x"}])["param"] == "questions[0].type"
    assert ask([])["param"] == "questions"
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]
    assert ask([{"type": "predicate", "instructions": "x"}], image)["param"] == "input[0].content[0]"
