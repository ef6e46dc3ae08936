"""Moderation on the bus: prompts published to ``requests.ingress`` and every token stream on
its way out, under the policy of the ``tokenbus.moderation`` library."""

from tokenbus.stream_processors.moderation.ingress import IngressModeration
from tokenbus.stream_processors.moderation.output import OutputModeration
from tokenbus.stream_processors.moderation.window import StreamWindows

__all__ = ["IngressModeration", "OutputModeration", "StreamWindows"]
