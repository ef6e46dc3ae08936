"""lm-evaluation-harness against the edge, as its users run it (``--model local-completions``):
its own API model (``LocalCompletionsAPI``, the real package) scores loglikelihood requests with a
prompt of token ids, ``echo``, one likeliest and one token each, and generates with stop
sequences, through an edge that has the model's tokenizer and the real embedded stack. The stack's
simulated engine scores a token by its place in its vocabulary (uniform where it is a word of it,
ruled out, -9999, past it), which gives the figures the harness must read back."""

import math
import uuid

import pytest

from tests.conftest import MODEL
from tests.expected import expected_output
from tests.gpu_consumers.tiny_model import build_tiny_model
from tokenbus.gpu_consumers.engines.simulated_words import VOCABULARY
from tokenbus.infra.devstack.processes import free_port
from tokenbus.sse_edge.protocol.logprobs import LOGPROB_FLOOR

UNIFORM = -math.log(len(VOCABULARY))
PAIRS = [("The bus carries", " every token"), ("Once upon a time", " the"), ("a", "!")]


def scored(token_id: int) -> float:
    return UNIFORM if token_id < len(VOCABULARY) else LOGPROB_FLOOR


@pytest.mark.parametrize("batch_size", [1, 3])  # 3: the pairs go as one request, a batch of prompts
async def test_loglikelihood_and_generation_requests_of_the_harness_are_served(stack, api_key, tmp_path, batch_size):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model_dir = build_tiny_model(tmp_path)
    name, port = f"edge-lm-eval-{uuid.uuid4().hex[:4]}", free_port()
    stack.start_edge(name, port, reply_partitions="3",
                     env={"TOKENBUS_EDGE_TOKENIZERS": f"{MODEL}:{model_dir / 'tokenizer.json'}"})
    try:
        lm = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model=MODEL,
                                 tokenizer=str(model_dir), tokenizer_backend="huggingface", max_length=512,
                                 header={"Authorization": f"Bearer {api_key}"}, batch_size=batch_size)
        likelihoods = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])
        generated = lm.generate_until([Instance("generate_until", {}, ("Once upon a time", {"until": ["\n"],
                                                                                          "max_gen_toks": 8}), 0)])
    finally:
        stack.processes[name].stop()
    for (context, continuation), (logprob, greedy) in zip(PAIRS, likelihoods, strict=True):
        _, tokens = lm._encode_pair(context, continuation)  # the harness's own split of the pair
        assert logprob == pytest.approx(sum(scored(t) for t in tokens), rel=1e-6)
        assert greedy == all(t < len(VOCABULARY) for t in tokens)  # the simulated model's likeliest are its words
    prompt = lm.tokenizer.decode(lm.tok_encode("Once upon a time"))
    want = await expected_output([{"role": "user", "content": prompt}], seed=1234, max_tokens=8, text_prompt=True)
    assert generated == [want.text]
