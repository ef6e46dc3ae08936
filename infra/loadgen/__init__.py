"""A load generator for OpenAI-compatible streaming endpoints (``tokenbus bench serve``)."""

from tokenbus.infra.loadgen.arrivals import arrival_gaps
from tokenbus.infra.loadgen.metrics import Slo, Summary, format_summary, percentile, summarize
from tokenbus.infra.loadgen.results import RequestResult
from tokenbus.infra.loadgen.runner import Progress, run_load
from tokenbus.infra.loadgen.sse_client import client_session, stream_chat

__all__ = [
    "Progress",
    "RequestResult",
    "Slo",
    "Summary",
    "arrival_gaps",
    "client_session",
    "format_summary",
    "percentile",
    "run_load",
    "stream_chat",
    "summarize",
]
