"""A request's messages and tools as prompt token ids, through the model's own chat template
(the ``hf`` and ``trtllm`` engines share it).

Chat templates that know tools (Qwen, Hermes, Llama 3.1+) take them as ``tools=`` and render the
function list and earlier calls their own way. A template that never mentions tools (SmolLM2's
ChatML, for one) would drop them silently, so for such a model the function list goes into a
system message in the ``hermes`` format the worker's parser reads (engines/tool_calls.py), and
earlier calls are written back the same way.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import threading
from collections import OrderedDict
from collections.abc import Container
from typing import Any, NamedTuple

from tokenbus.gpu_consumers.engines.base import GenerationInput, InvalidInput
from tokenbus.gpu_consumers.engines.blocks import ChainHash, block_hashes, leading_held
from tokenbus.gpu_consumers.engines.detokenize import rust_tokenizer
from tokenbus.gpu_consumers.engines.tool_calls import render_call
from tokenbus.schemas import TOOL_CHOICE_FUNCTION, TOOL_CHOICE_REQUIRED, ChatMessage
from tokenbus.schemas.prefixes import segment_hashes

TOOLS_INSTRUCTION = (
    "You may call one or more functions to assist with the user query. The functions are listed "
    "within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n"
    "For each function call, return a JSON object with the function name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


def template_tools(inp: GenerationInput) -> list[dict[str, Any]]:
    """The offered functions in the shape chat templates (and OpenAI's API) use."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": json.loads(t.parameters)}}
            for t in inp.tools]


def template_message(message: ChatMessage, knows_tools: bool) -> dict[str, Any]:
    if knows_tools:
        out: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                 for c in message.tool_calls]
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        return out
    if message.tool_calls:  # written back as the model would have written them
        calls = "\n".join(render_call(c.name, json.loads(c.arguments)) for c in message.tool_calls)
        return {"role": "assistant", "content": "\n".join(filter(None, [message.content, calls]))}
    if message.role == "tool":  # ChatML has no tool role: a result goes back as the user's words
        return {"role": "user", "content": f"<tool_response>\n{message.content}\n</tool_response>"}
    return {"role": message.role, "content": message.content}


def instruction(inp: GenerationInput) -> str:
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in template_tools(inp))
    text = TOOLS_INSTRUCTION.format(tools=tools)
    if inp.tool_choice == TOOL_CHOICE_FUNCTION:
        text += f"\nYou must call the function {inp.tool_choice_name}."
    elif inp.tool_choice == TOOL_CHOICE_REQUIRED:
        text += "\nYou must call at least one function."
    return text


def _conversation(tokenizer: Any, inp: GenerationInput) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and options the chat template is given for ``inp``."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    knows_tools = "tools" in template
    messages = [template_message(m, knows_tools) for m in inp.messages]
    options: dict[str, Any] = {}
    if inp.offers_tools:
        if knows_tools:
            options["tools"] = template_tools(inp)
        elif messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{instruction(inp)}"}
        else:
            messages.insert(0, {"role": "system", "content": instruction(inp)})
    return messages, options


def prompt_ids(tokenizer: Any, inp: GenerationInput, add_generation_prompt: bool = True) -> list[int]:
    """The prompt's token ids; without ``add_generation_prompt``, just its messages (a prefix of a
    longer prompt, for the prefix cache's layout). A text prompt is tokenized as it is, with the
    tokenizer's special tokens (a Llama's BOS), as a text completion server does; one given as token
    ids is those ids."""
    if inp.prompt_token_ids:
        return list(inp.prompt_token_ids)
    if inp.text_prompt:
        return list(tokenizer(inp.messages[0].content)["input_ids"])
    ids = _templated(tokenizer, inp, add_generation_prompt, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids)


def prompt_text(tokenizer: Any, inp: GenerationInput, add_generation_prompt: bool = True) -> str:
    """The prompt as the chat template writes it, before tokenizing (a text prompt as it is)."""
    if inp.text_prompt:
        return inp.messages[0].content
    return str(_templated(tokenizer, inp, add_generation_prompt, tokenize=False))


def _templated(tokenizer: Any, inp: GenerationInput, add_generation_prompt: bool, tokenize: bool) -> Any:
    """The chat template applied as ``inp`` asks (vLLM's ``add_generation_prompt`` and
    ``continue_final_message``); a final message the template cannot leave open is ``InvalidInput``."""
    messages, options = _conversation(tokenizer, inp)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and inp.add_generation_prompt,
                                             continue_final_message=inp.continue_final_message, tokenize=tokenize, **options)
    except ValueError as exc:
        if not inp.continue_final_message:
            raise
        raise InvalidInput(f"the chat template cannot continue the final message: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A prompt's text and where each of its token ids ends in it (characters), non-decreasing."""

    text: str
    token_ends: tuple[int, ...]

    def tokens_within(self, chars: int) -> int:
        """How many of the prompt's first tokens lie within its first ``chars`` characters."""
        return bisect.bisect_right(self.token_ends, chars)


class Prompt(NamedTuple):
    """A request's prompt as its engine takes it: the token ids, the text they came from where the
    tokenizer says where each token lies in it, and the names of its full blocks of tokens for the
    engine's prefix cache (empty where it names none)."""

    ids: list[int]
    rendered: Rendered | None
    blocks: tuple[int, ...]

    def reusable_tokens(self, block_tokens: int, held: Container[int]) -> int:
        """What an engine whose cache holds the blocks named ``held`` reuses of this prompt: its
        leading blocks held, never its last token (the prefill gives that one's logits)."""
        return leading_held(self.blocks[:(len(self.ids) - 1) // block_tokens], held) * block_tokens


class PromptTokens:
    """A request's prompt token ids, made once. A worker asks its engine for a request's generation
    and its prefix cache for the request's layout back to back (gpu_consumers/worker.py), and
    templating and tokenizing a long conversation costs milliseconds (4.5 ms for 1,900 tokens of
    SmolLM2's tokenizer on a slow spell here), so the last one made is remembered. ``prepare`` makes
    them ahead, in a thread (``Engine.prepare``): with a fast tokenizer the text is tokenized by its
    Rust tokenizer's ``encode_batch``, which lets go of the GIL (``encode`` holds it), so the event
    loop goes on meanwhile; the ids are what ``apply_chat_template`` gives, and the tokens' places
    in the text come with them, for ``SegmentEnds``. Given an engine's block size and chain hash
    (``name_blocks``), the prompt's blocks are named there too, once for the engine and the layout
    it reports for KV-cache-aware routing (~7 µs a 32-token block, which the event loop spent twice
    a request before: a 2,000-token prompt's ~0.4 ms). What is returned is shared: callers must not
    change it."""

    PREPARED = 1024  # prompts made ahead and not yet asked for, at most (the oldest are dropped)

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._rust = rust_tokenizer(tokenizer)
        self._blocks: tuple[int, ChainHash] | None = None
        self._prepared: OrderedDict[tuple[Any, ...], Prompt] = OrderedDict()
        self._lock = threading.Lock()  # ``prepare`` runs in threads
        self._last: tuple[tuple[Any, ...], Prompt] | None = None

    def name_blocks(self, block_tokens: int, chain: ChainHash) -> None:
        """Name each prompt's full blocks of ``block_tokens`` with ``chain`` (before any is made)."""
        self._blocks = (block_tokens, chain)

    def _make(self, inp: GenerationInput) -> Prompt:
        if self._rust is None or inp.prompt_token_ids:  # (token ids: where each lies in a text is not asked)
            ids, rendered = prompt_ids(self._tokenizer, inp), None
        else:
            text = prompt_text(self._tokenizer, inp)
            # A chat template writes its special tokens into the text; a text prompt gets the tokenizer's.
            encoding = self._rust.encode_batch([text], add_special_tokens=inp.text_prompt)[0]
            ids, rendered = list(encoding.ids), Rendered(text, tuple(end for _, end in encoding.offsets))
        if inp.truncate_prompt_tokens is not None:  # vLLM's: the last tokens alone (no text places them)
            ids, rendered = ids[-inp.truncate_prompt_tokens:], None
        blocks = block_hashes(ids, self._blocks[0], chain=self._blocks[1]) if self._blocks is not None else ()
        return Prompt(ids, rendered, blocks)

    def prepare(self, inp: GenerationInput) -> None:
        """Make ``inp``'s prompt now (in a thread), for the next ask; a failure is left to that ask."""
        try:
            made = self._make(inp)
            with self._lock:
                self._prepared[inp.prompt_key] = made  # (a list where a tuple belongs cannot be a key)
                while len(self._prepared) > self.PREPARED:
                    self._prepared.popitem(last=False)
        except Exception:
            return

    def prompt(self, inp: GenerationInput) -> Prompt:
        key = inp.prompt_key
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        try:
            with self._lock:
                made = self._prepared.pop(key, None)
        except TypeError:  # content that cannot be hashed was never prepared
            made = None
        if made is None:
            made = self._make(inp)
        self._last = (key, made)
        return made

    def __call__(self, inp: GenerationInput) -> list[int]:
        return self.prompt(inp).ids

    def rendered(self, inp: GenerationInput) -> Rendered | None:
        """The prompt's text and token ends, where the tokenizer says them."""
        return self.prompt(inp).rendered


class SegmentEnds:
    """Where each segment of a prompt (schemas/prefixes.py) ends in its token ids: the tokens of the
    prompt that lie within the text of its first messages, as the template writes them alone; or,
    where the tokens' places in the text are not known or the template writes a prefix of the
    messages differently, where the ids of those messages alone stop agreeing with the prompt's.
    The functions are written into the first message, so they end no prefix of their own (0). An
    end depends only on its prefix, so the last few thousand are kept."""

    def __init__(self, tokenizer: Any, remembered: int = 4096) -> None:
        self._tokenizer = tokenizer
        self._remembered = remembered
        self._ends: OrderedDict[int, int] = OrderedDict()

    def __call__(self, inp: GenerationInput, ids: list[int], rendered: Rendered | None = None) -> tuple[int, ...]:
        if inp.truncate_prompt_tokens is not None:  # what is kept begins at no segment's start
            return ()
        ends = [0] if inp.offers_tools else []
        for i, prefix in enumerate(segment_hashes(inp)[len(ends):]):
            end = self._ends.get(prefix)
            if end is None:
                # (the messages as they stand in a longer prompt: closed, even where the final one is left open)
                part = dataclasses.replace(inp, messages=inp.messages[:i + 1], continue_final_message=False)
                end = self._end_of(part, ids, rendered)
                self._ends[prefix] = end
                while len(self._ends) > self._remembered:
                    self._ends.popitem(last=False)
            ends.append(end)
        return tuple(ends)

    def _end_of(self, part: GenerationInput, ids: list[int], rendered: Rendered | None) -> int:
        if rendered is not None:
            text = prompt_text(self._tokenizer, part, add_generation_prompt=False)
            if rendered.text.startswith(text):
                return rendered.tokens_within(len(text))
        part_ids = prompt_ids(self._tokenizer, part, add_generation_prompt=False)
        return next((n for n, (a, b) in enumerate(zip(part_ids, ids)) if a != b), min(len(part_ids), len(ids)))
