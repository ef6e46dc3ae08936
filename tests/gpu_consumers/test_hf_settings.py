"""How the hf engine sizes continuous batching per device: the CPU keeps the explicit small
cache it always had; CUDA takes the worker's batch size and leaves the cache size, graphs and
async batching to transformers (graphs with SDPA's mask were measured ten times slower); set
values always win. No GPU needed: this is the configuration handed to transformers."""

import pytest

from tokenbus.gpu_consumers.engines import InvalidInput
from tokenbus.gpu_consumers.engines.hf import HfEngine
from tokenbus.gpu_consumers.engines.hf_loading import HfEngineSettings, batching_config


def test_the_cpu_keeps_its_explicit_small_cache():
    config = batching_config(HfEngineSettings(), "cpu", max_num_seqs=64)
    assert (config["num_blocks"], config["max_batch_tokens"], config["max_requests_per_batch"]) == (64, 512, 16)
    assert (config["use_cuda_graph"], config["use_async_batching"]) == (False, False)


def test_cuda_batches_what_the_worker_admits_and_sizes_the_cache_from_gpu_memory():
    config = batching_config(HfEngineSettings(), "cuda", max_num_seqs=64)
    assert config["max_requests_per_batch"] == 64
    assert (config["num_blocks"], config["max_batch_tokens"], config["max_memory_percent"]) == (None, None, None)
    assert (config["use_cuda_graph"], config["use_async_batching"]) == (None, None)


def test_settings_win_over_the_device_defaults(monkeypatch):
    monkeypatch.setenv("TOKENBUS_HF_MAX_REQUESTS_PER_BATCH", "32")
    monkeypatch.setenv("TOKENBUS_HF_NUM_BLOCKS", "4096")
    monkeypatch.setenv("TOKENBUS_HF_CUDA_GRAPHS", "true")
    config = batching_config(HfEngineSettings(), "cuda", max_num_seqs=256)
    assert (config["max_requests_per_batch"], config["num_blocks"], config["use_cuda_graph"]) == (32, 4096, True)


def test_the_manager_scores_sampled_tokens_unless_turned_off_and_refuses_what_it_cannot_score(monkeypatch):
    """``return_logprobs`` on by default, so that ``logprobs`` is served; turned off, or asked for
    ``top_logprobs``, the manager refuses with a reason that names the setting or the slots."""
    assert batching_config(HfEngineSettings(), "cpu", max_num_seqs=8)["return_logprobs"] is True
    HfEngine(HfEngineSettings())._manager_scores(0)  # served
    with pytest.raises(InvalidInput, match="TOKENBUS_HF_BATCHING=slots"):
        HfEngine(HfEngineSettings())._manager_scores(2)
    monkeypatch.setenv("TOKENBUS_HF_MANAGER_LOGPROBS", "false")
    assert batching_config(HfEngineSettings(), "cpu", max_num_seqs=8)["return_logprobs"] is False
    with pytest.raises(InvalidInput, match="TOKENBUS_HF_MANAGER_LOGPROBS=true"):
        HfEngine(HfEngineSettings())._manager_scores(0)
