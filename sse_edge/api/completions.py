"""``POST /v1/completions``: a text completion (OpenAI's legacy API, which vLLM's ``bench serve``
and evaluation harnesses call): a prompt, as text or as the model's token ids, which the model
continues as it is, with no chat template; or a batch of prompts, a choice each (``n`` each with
``n``). A prompt is a chat turn on the bus (a ``ChatRequest`` whose one user message is the
prompt, marked ``text_prompt``), so keys, limits, idempotency, moderation, billing and
transcripts treat it as one (chat.py serves it from ``answer`` on); what differs is the prompt the
engine makes and the shapes the client gets (``text_completion``, with no role chunk). Its stream
is resumed and its turn continued through the chat completion's routes, in the same shapes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.schemas import TOOL_CHOICE_NONE, ChatMessage, ChatRequest
from tokenbus.sse_edge.api.chat import answer, generation_fields
from tokenbus.sse_edge.plumbing.context import kept
from tokenbus.sse_edge.protocol.completions import CompletionRequest
from tokenbus.sse_edge.protocol.validation import parse_completion_request
from tokenbus.sse_edge.state import EdgeState
from tokenbus.stores.keys import ApiKey


async def completions(request: Request) -> Response:
    return await answer(request, parse_completion_request, "cmpl", text_bus_requests)


async def text_bus_requests(completion: CompletionRequest, edge: EdgeState, key: ApiKey,
                            request_id: str) -> list[ChatRequest]:
    """The bus request of each prompt; a prompt of token ids goes as they are, with their text (``decode``)."""
    return [text_bus_request(completion, prompt, edge, key, request_id) for prompt in completion.prompts]


def text_bus_request(completion: CompletionRequest, prompt: str | list[int], edge: EdgeState, key: ApiKey,
                     request_id: str) -> ChatRequest:
    context = edge.context
    if isinstance(prompt, str):
        made = to_bus_request(completion, edge, key, request_id, prompt)
        context.check_messages(completion.model, made.messages, completion.token_limit, param="prompt",
                               truncate=completion.truncate_prompt_tokens)
        return made
    text = context.decode(completion.model, prompt)
    if context.limits(completion.model):
        context.check(completion.model, kept(len(prompt), completion.truncate_prompt_tokens),
                      completion.token_limit, param="prompt")
    return to_bus_request(completion, edge, key, request_id, text, prompt)


def to_bus_request(completion: CompletionRequest, edge: EdgeState, key: ApiKey, request_id: str, text: str,
                   token_ids: list[int] | None = None) -> ChatRequest:
    return ChatRequest(**generation_fields(completion, edge, key, request_id),
                       messages=[ChatMessage("user", text)], text_prompt=True,
                       tool_choice=TOOL_CHOICE_NONE, echo=completion.echo, prompt_token_ids=token_ids or [])
