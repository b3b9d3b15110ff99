"""Anthropic's prompt caching as a contract, for the Messages route.

- **Retention.** Each ``cache_control`` asks for its ttl (``5m``, the default, or ``1h``); the
  longest one marked is how long the worker's cache and the KV store keep the prompt's blocks ahead
  of unmarked ones (``NewRequest.retain_s``; worker/block_manager.py, worker/kv_store/disk.py).
- **Usage.** As Anthropic counts: ``cache_creation_input_tokens`` are the prompt's tokens up to
  its last breakpoint that the cache did not hold, ``cache_read_input_tokens`` those it served, and
  ``input_tokens`` the rest (after the breakpoint). Where the breakpoint falls in the rendered
  prompt is measured, not guessed: the request is rendered again with a marker block right after
  its last breakpoint, and the prompt's tokens are counted up to the marker, from their bytes: a
  byte-level BPE token string holds one character per byte. That costs the render, not a second
  tokenizing (3-7x more: ``breakpoint_tokens``); where the bytes do not add up (another kind of
  tokenizer, a template that put more than the marker in, images) the marked prompt is tokenized
  too, and the two prompts part where the breakpoint ends.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

import msgspec

from gateway.errors import GatewayError, InvalidRequest
from gateway.generate import core
from gateway.generate.events import Usage
from gateway.http.routes.messages_input import core_request
from gateway.schemas.anthropic import AnthropicTool, AnthropicUsage, ContentBlock, MessagesRequest, SystemBlock

TTL_S = {"5m": 300.0, "1h": 3600.0}
MARK = "\u2063\u2063"  # an invisible separator: text that follows no breakpoint's text in practice


def breakpoints(data: MessagesRequest) -> list[dict]:
    """Every ``cache_control`` the request marks: at the top, on tools, system blocks and message blocks."""
    blocks: list = [data, *(data.tools or []), *(data.system if isinstance(data.system, list) else [])]
    blocks += [b for m in data.messages if isinstance(m.content, list) for b in m.content]
    return [b.cache_control for b in blocks if isinstance(b.cache_control, dict)]


def retention_s(data: MessagesRequest) -> float:
    """How long the marks ask the prompt's blocks to be kept (0: no mark); a bad ttl is a 400."""
    ttls = [mark.get("ttl", "5m") for mark in breakpoints(data)]
    for ttl in ttls:
        if ttl not in TTL_S:
            raise InvalidRequest(f'`cache_control.ttl` must be "5m" or "1h"; got {ttl!r}', param="cache_control.ttl")
    return max((TTL_S[ttl] for ttl in ttls), default=0.0)


def _marked(data: MessagesRequest) -> MessagesRequest | None:
    """The request with a marker right after its last breakpoint, in prompt order (tools, system,
    messages; a top-level mark is on the last message's last block); None: nothing is marked."""
    replace = msgspec.structs.replace
    mark = ContentBlock(type="text", text=MARK)
    if data.cache_control is not None:
        return _after_block(data, len(data.messages) - 1, None, mark)
    for i in reversed(range(len(data.messages))):
        content = data.messages[i].content
        for j in reversed(range(len(content) if isinstance(content, list) else 0)):
            if content[j].cache_control is not None:  # type: ignore[union-attr]
                return _after_block(data, i, j, mark)
    system = data.system if isinstance(data.system, list) else []
    for j in reversed(range(len(system))):
        if system[j].cache_control is not None:
            return replace(data, system=[*system[: j + 1], SystemBlock(type="text", text=MARK), *system[j + 1 :]])
    tools = data.tools or []
    for j in reversed(range(len(tools))):
        if tools[j].cache_control is not None:
            marker = AnthropicTool(name="cache_mark", description=MARK, input_schema={"type": "object"})
            return replace(data, tools=[*tools[: j + 1], marker, *tools[j + 1 :]])
    return None


def _after_block(data: MessagesRequest, i: int, j: int | None, mark: ContentBlock) -> MessagesRequest:
    """``data`` with ``mark`` after block ``j`` of message ``i`` (None: after its last block)."""
    message = data.messages[i]
    content = message.content
    blocks = [ContentBlock(type="text", text=content)] if isinstance(content, str) else list(content)
    at = len(blocks) if j is None else j + 1
    marked = msgspec.structs.replace(message, content=[*blocks[:at], mark, *blocks[at:]])
    return msgspec.structs.replace(data, messages=[*data.messages[:i], marked, *data.messages[i + 1 :]])


async def marked_tokens(generation: core.Generation, data: MessagesRequest) -> int:
    """How many of the prompt's tokens come up to its last cache breakpoint (0: none is marked)."""
    marked = _marked(data)
    if marked is None:
        return 0
    prompt = generation.prompts[0]
    try:
        text = await core.chat_text(generation.served, core_request(marked))
        if text is not None and (upto := breakpoint_tokens(generation.served.tokenizer, prompt, text)) is not None:
            return upto
        (other,) = await core.prompt_ids(generation.served, core_request(marked))
    except GatewayError:  # the marker broke a check: count the whole prompt as written
        return len(prompt)
    same = next((k for k, (a, b) in enumerate(zip(prompt, other)) if a != b), min(len(prompt), len(other)))
    return same


def breakpoint_tokens(tokenizer: Any, prompt: list[int], marked: str) -> int | None:
    """The tokens of ``prompt`` that end before the marker in ``marked`` (its render with the
    marker), from each token's bytes: a byte-level BPE's token strings hold one character per byte,
    an added token its text. None unless those bytes are exactly ``marked`` without the marker."""
    cut = marked.find(MARK)
    if cut < 0:
        return None
    head = len(marked[:cut].encode())
    added = tokenizer.added_tokens_decoder
    tokens = tokenizer.convert_ids_to_tokens(prompt)
    sizes = [len(added[i].content.encode()) if i in added else len(t) for i, t in zip(prompt, tokens)]
    if sum(sizes) != head + len(marked[cut + len(MARK) :].encode()):
        return None
    return bisect.bisect_right(list(itertools.accumulate(sizes)), head)


def anthropic_usage(usage: Usage, upto: int = 0) -> AnthropicUsage:
    """Anthropic's split of the prompt: read from the cache, written up to the last breakpoint
    (``upto`` tokens; 0: nothing marked, nothing written), and the rest."""
    written = max(0, min(upto, usage.prompt_tokens) - usage.cached_tokens)
    return AnthropicUsage(
        input_tokens=usage.prompt_tokens - usage.cached_tokens - written,
        output_tokens=usage.completion_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=usage.cached_tokens,
    )
