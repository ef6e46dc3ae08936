"""What a request's engine steps become on the bus: its TokenEvents, numbered on from what was
already published, with function calls read out of the engine's text for a request that offers
them (only such a request pays for the parser)."""

from __future__ import annotations

from tokenbus.gpu_consumers.engines import FINISH_STOP, FINISH_TOOL_CALLS, StepOutput
from tokenbus.gpu_consumers.engines.tool_calls import TOOL_PARSERS, HermesToolParser
from tokenbus.gpu_consumers.token_log import Published
from tokenbus.schemas import ChatRequest, TokenEvent


class StepEvents:
    def __init__(self, request: ChatRequest, worker_id: str, tool_parser: str, published: Published | None = None,
                 admitted_at_ms: int | None = None) -> None:
        self.request = request
        self._worker_id = worker_id
        self._admitted_at_ms = admitted_at_ms
        self._calls = self._parser(tool_parser, published or Published())

    def _parser(self, name: str, published: Published) -> HermesToolParser | None:
        request = self.request
        if not request.offers_tools:
            return None
        offered = {t.name for t in request.tools}
        if request.tool_choice_name is not None:
            offered &= {request.tool_choice_name}
        return TOOL_PARSERS[name](request.request_id, offered, published.tool_calls, request.parallel_tool_calls)

    def event(self, seq: int, out: StepOutput) -> TokenEvent:
        """The event of step ``out``, the ``seq``-th of the request."""
        request = self.request
        if self._calls is None and seq and out.finish_reason is None:  # most events: the fields left out are None
            return TokenEvent(request_id=request.request_id, seq=seq, text=out.text_diff,
                              token_ids=list(out.token_ids_diff), error=out.error, worker_id=self._worker_id,
                              logprobs=list(out.logprobs))
        text, calls, raw_text, finish_reason = out.text_diff, [], None, out.finish_reason
        if self._calls is not None:
            parsed = self._calls.feed(out.text_diff)
            if out.finished:
                rest = self._calls.flush()
                parsed.content, parsed.raw = parsed.content + rest.content, parsed.raw + rest.raw
                if finish_reason == FINISH_STOP and self._calls.calls:
                    finish_reason = FINISH_TOOL_CALLS
            text, calls, raw_text = parsed.content, parsed.calls, parsed.raw_text
        return TokenEvent(
            request_id=request.request_id,
            seq=seq,
            text=text,
            tool_calls=calls,
            raw_text=raw_text,
            token_ids=list(out.token_ids_diff),
            finish_reason=finish_reason,
            error=out.error,
            # On the first event too: an edge that closes a stream nothing finishes bills its prompt.
            prompt_tokens=out.prompt_tokens if out.finished or seq == 0 else None,
            completion_tokens=out.completion_tokens if out.finished else None,
            cached_tokens=out.cached_tokens if out.finished or seq == 0 else None,
            worker_id=self._worker_id,
            tenant=request.tenant if seq == 0 else None,
            tier=request.tier if seq == 0 else None,
            admitted_at_ms=self._admitted_at_ms if seq == 0 else None,
            logprobs=list(out.logprobs),
            echo=echoed(request) if seq == 0 and request.echo else None,
            prompt_logprobs=list(out.prompt_logprobs),
        )


def echoed(request: ChatRequest) -> str | None:
    """What an echo gives back: a text completion's prompt; a chat's final message where it is the
    assistant's (vLLM's chat echo: the reply goes on from it), else nothing."""
    final = request.messages[-1]
    return final.content if request.text_prompt or final.role == "assistant" else None
