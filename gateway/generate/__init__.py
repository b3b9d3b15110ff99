"""The generation core: one for every dialect, knowing nothing of the web framework.

request.py             CoreRequest: what a dialect translated its body into, before any check
core.py                start (check, tokenize, admit) and the Generation: its events per choice, or its choices
validation.py          every check of a request, in order, before admission (``prepare``)
served_model.py        ServedModel: a model's tokenizer, template and workers; one wire request's text deltas
model_registry.py      the models this gateway serves, each learned from its first worker
abilities.py           what a model can do (generate, embed, score), as its workers said
events.py              what the core hands back: Text, Thinking, ToolCallDelta, PromptLogprobs, Finish, Choice, Usage
templates.py           chat templates in a jinja2 sandbox, and the prompt budget
tokenizer.py           token ids -> text, incrementally
stop.py                stop strings over streamed text
tools.py               tool calling: tools into the prompt, tool_choice into a grammar, output into tool_calls
reasoning.py           a reasoning model's thinking split from its answer, and the thinking budget
logprobs.py            log-probabilities in OpenAI's two shapes
structured_outputs.py  vLLM's guided-decoding fields as the core's output format
lanes.py               work off the event loop, and work that stops when its client hangs up
vision.py              images into an image-text model's prompt, through its processor (placeholders, pixels)
media.py               images fetched and decoded safely: data: URIs, http(s) with limits, no private addresses
pooling.py             the pooling core (embeddings, rerank, score), as core.py is for generation
decisions.py           OpenAI's Decisions: questions over one input, answered from label-token probabilities
"""
