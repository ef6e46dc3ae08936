"""What one benchmarked request measured."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestResult:
    """Times are seconds. ``itl`` holds every gap between successive output chunks."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the server's prefix cache (where it says)
    response_id: str = ""  # the completion's id, as the server named it
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    chunks: int = 0
    _last_chunk_at: float = 0.0

    def chunk_arrived(self, at: float, started: float) -> None:
        """A content chunk arrived at ``at``: the first sets TTFT, later ones add a gap."""
        if self.chunks == 0:
            self.ttft = at - started
        else:
            self.itl.append(at - self._last_chunk_at)
        self._last_chunk_at = at
        self.chunks += 1

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's definition)."""
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)
