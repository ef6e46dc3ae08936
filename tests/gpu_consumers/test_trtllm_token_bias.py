"""The `trtllm` engine's logit bias (``TokenBias``, engines/trtllm.py): a logits processor of the
request's own, checked on the logits tensors TensorRT-LLM's PyTorch backend hands it (no engine
runs: it is a function of the logits)."""

import math

from tokenbus.gpu_consumers.engines.trtllm import TokenBias


def test_a_logit_bias_is_a_logits_processor_that_adds_to_the_ids_it_names_alone():
    """``TokenBias`` (the request's ``logits_processor``) adds in place, whatever the logits' leading
    dimensions (the PyTorch backend's [1, beam, vocabulary]) and dtype, to the named ids alone; with
    allowed tokens, it rules out every other one."""
    import torch

    bias = TokenBias(((2, 100.0), (5, -1.5)))
    logits = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    logits[..., 2] = 0.5
    bias(7, logits, [[1, 2, 3]], None, None)
    assert logits[0, 0].tolist() == logits[0, 1].tolist() == [0, 0, 100.5, 0, 0, -1.5, 0, 0]
    allowing = TokenBias(((5, 2.0),), allowed=(1, 5))  # vLLM's allowed_token_ids: -inf for the rest
    logits = torch.zeros(1, 1, 8)
    allowing(7, logits, [[1]], None, None)
    assert logits[0, 0].tolist() == [-math.inf, 0, -math.inf, -math.inf, -math.inf, 2, -math.inf, -math.inf]
