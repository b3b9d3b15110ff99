"""A Responses API answer built from the core's events: its output items (a reasoning model's
``reasoning`` with its ``reasoning_text``, a ``message`` with ``output_text``, a ``function_call``
per call) and, streamed, OpenAI's typed events in order, each
with an increasing ``sequence_number``, encoded as they are made (``gateway.state.runs.Event``).
Item ids derive from the response's id and the item's place, so a gateway that takes a response
over and replays it makes the same events."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.errors import GatewayError
from gateway.generate import core, events
from gateway.generate.events import LENGTH, Finish, Text, Thinking, ToolCallDelta
from gateway.generate.logprobs import chat_logprobs
from gateway.generate.served_model import ServedModel
from gateway.schemas.responses import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    Logprob,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseObject,
    ResponseUsage,
)
from gateway.state.runs import Event

_encoder = msgspec.json.Encoder()


class Output:
    """Builds the output items from the core's events, as the stream's events (the non-streamed
    answer is the same walk over the collected choice, its events dropped)."""

    def __init__(self, served: ServedModel, response: ResponseObject, with_logprobs: bool) -> None:
        self.served = served
        self.response = response
        self.with_logprobs = with_logprobs
        self._sequence = itertools.count()
        self._open: ReasoningItem | OutputMessage | FunctionCallItem | None = None

    def event(self, kind: str, **fields: Any) -> Event:
        """The event as JSON now: later changes to the items it names (text growing) are not in it."""
        seq = next(self._sequence)
        return Event(kind, seq, _encoder.encode({"type": kind, "sequence_number": seq, **fields}))

    def _item_id(self, prefix: str) -> str:
        """Ids that come out the same when a gateway replays this response after a takeover."""
        return f"{prefix}_{self.response.id.removeprefix('resp_')}{len(self.response.output):04x}"

    async def stream(self, generation: core.Generation) -> AsyncIterator[Event]:
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)
        try:
            async for event in self.events(generation, None):
                yield event
        except GatewayError as exc:
            self.response.status = "failed"
            self.response.error = ResponseError(exc.error_type, exc.message)
            yield self.event("response.failed", response=self.response)

    async def events(self, generation: core.Generation, choices: list[events.Choice] | None) -> AsyncIterator[Event]:
        """The items' events, from the live stream (``choices`` None) or from a collected choice."""
        finish: Finish | None = None
        async for event in _replay(choices[0]) if choices else generation.events():
            if isinstance(event, Text) and (event.text or event.logprobs):
                for out in self._text(event):
                    yield out
            elif isinstance(event, Thinking) and not self.response.reasoning.exclude:  # OpenRouter's exclude
                for out in self._thinking(event):
                    yield out
            elif isinstance(event, ToolCallDelta):
                for out in self._call(event):
                    yield out
            elif isinstance(event, Finish):
                finish = event
        if not any(
            isinstance(item, OutputMessage | FunctionCallItem) for item in self.response.output
        ):  # nothing said: an empty message, as OpenAI
            for out in self._text(Text(0, "")):
                yield out
        incomplete = finish is not None and finish.reason == LENGTH
        for out in self._close("incomplete" if incomplete else "completed"):
            yield out
        usage = finish.usage if finish else events.Usage()
        self.response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(usage.reasoning_tokens),
            total_tokens=usage.total_tokens,
        )
        self.response.status = "incomplete" if incomplete else "completed"
        self.response.incomplete_details = IncompleteDetails("max_output_tokens") if incomplete else None
        yield self.event(f"response.{self.response.status}", response=self.response)

    def _text(self, event: Text) -> list[Event]:
        out = (
            []
            if isinstance(self._open, OutputMessage)
            else self._open_item(
                OutputMessage(id=self._item_id("msg"), status="in_progress", content=[]), OutputText(text="")
            )
        )
        part = self._open.content[0]  # type: ignore[union-attr]
        logprobs = self._logprobs(event)
        part.text += event.text
        part.logprobs.extend(logprobs)
        if event.text or logprobs:
            out.append(self._part_event("response.output_text.delta", delta=event.text, logprobs=logprobs))
        return out

    def _thinking(self, event: Thinking) -> list[Event]:
        out = (
            []
            if isinstance(self._open, ReasoningItem)
            else self._open_item(
                ReasoningItem(id=self._item_id("rs"), status="in_progress", content=[]), ReasoningText(text="")
            )
        )
        self._open.content[0].text += event.text  # type: ignore[union-attr]
        out.append(self._part_event("response.reasoning_text.delta", delta=event.text))
        return out

    def _open_item(self, item: OutputMessage | ReasoningItem, part: OutputText | ReasoningText) -> list[Event]:
        """Close the open item and start ``item`` with its one (empty) text part."""
        out = self._close("completed")
        self._open = item
        self.response.output.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.response.output) - 1, item=item))
        item.content.append(part)  # type: ignore[arg-type]
        out.append(self._part_event("response.content_part.added", part=part))
        return out

    def _part_event(self, kind: str, **fields: Any) -> Event:
        """An event of the text part of the item being written (the last output item)."""
        return self.event(
            kind, item_id=self._open.id, output_index=len(self.response.output) - 1, content_index=0, **fields
        )  # type: ignore[union-attr]

    def _logprobs(self, event: Text) -> list[Logprob]:
        if not self.with_logprobs:
            return []
        return [
            msgspec.convert(entry, Logprob)
            for entry in chat_logprobs(self.served.token_texts, event.logprobs)["content"]
        ]

    def _call(self, event: ToolCallDelta) -> list[Event]:
        out = []
        call = event.call
        if call.id is not None:
            out += self._close("completed")
            call_id = self._item_id("call")
            self._open = FunctionCallItem(
                id=self._item_id("fc"), call_id=call_id, name=call.name or "", arguments="", status="in_progress"
            )
            self.response.output.append(self._open)
            out.append(
                self.event("response.output_item.added", output_index=len(self.response.output) - 1, item=self._open)
            )
        item = self._open
        if isinstance(item, FunctionCallItem) and call.arguments:
            item.arguments += call.arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=len(self.response.output) - 1,
                    delta=call.arguments,
                )
            )
        return out

    def _summary(self, item: ReasoningItem, index: int) -> list[Event]:
        """``reasoning.summary`` asked for: the thinking, once whole, as the item's one summary part
        (no summarizing model here: the summary is the reasoning itself), with OpenAI's summary events."""
        text = item.content[0].text
        item.summary = [{"type": "summary_text", "text": text}]
        where = {"item_id": item.id, "output_index": index, "summary_index": 0}
        return [
            self.event("response.reasoning_summary_part.added", **where, part={"type": "summary_text", "text": ""}),
            self.event("response.reasoning_summary_text.delta", **where, delta=text),
            self.event("response.reasoning_summary_text.done", **where, text=text),
            self.event("response.reasoning_summary_part.done", **where, part=item.summary[0]),
        ]

    def _close(self, status: str) -> list[Event]:
        """The done events of the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.response.output.index(item)
        out = []
        if isinstance(item, ReasoningItem):
            part = item.content[0]
            out.append(
                self.event(
                    "response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0, text=part.text
                )
            )
            out.append(
                self.event(
                    "response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
                )
            )
            out += self._summary(item, index) if self.response.reasoning.summary else []
        elif isinstance(item, OutputMessage):
            part = item.content[0]
            out.append(
                self.event(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=part.text,
                    logprobs=part.logprobs,
                )
            )
            out.append(
                self.event(
                    "response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part
                )
            )
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        item.status = status
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _replay(choice: events.Choice) -> AsyncIterator[events.Event]:
    """A collected choice as the events that made it."""
    if choice.reasoning:
        yield Thinking(0, choice.reasoning)
    if choice.text or choice.logprobs:
        yield Text(0, choice.text if not choice.tool_calls else (choice.content or ""), choice.logprobs)
    for i, call in enumerate(choice.tool_calls):
        yield ToolCallDelta(0, call.delta(i))
    if choice.finish is not None:
        yield choice.finish
