"""``tensorrt_llm.llmapi.KvCacheConfig``, the part of it the fake honours: block reuse and the
KV-cache event buffer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvCacheConfig:
    enable_block_reuse: bool = True
    free_gpu_memory_fraction: float | None = None
    event_buffer_max_size: int = 0


@dataclass
class GuidedDecodingParams:
    """``tensorrt_llm.llmapi.GuidedDecodingParams``: the output follows ``json`` (a JSON Schema, as
    text or a dict), with ``json_object`` is a JSON object, or matches ``regex``. The fake answers
    with one fixed instance of it (``instance_of``; for a regex, a text drawn from it), where the
    real engine decodes under the grammar."""

    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False

    def answer(self) -> str:
        import json as json_module

        if self.json is not None:
            schema = json_module.loads(self.json) if isinstance(self.json, str) else self.json
            return json_module.dumps(instance_of(schema))
        if self.json_object:
            return json_module.dumps({"answer": "fake"})
        if self.regex is not None:  # one text it matches, drawn with a fixed seed
            import random

            from tokenbus.gpu_consumers.engines.simulated_answers import regex_sample

            return regex_sample(self.regex, random.Random(0))
        raise NotImplementedError("the fake guides JSON and regular expressions alone")


def instance_of(schema: object) -> object:
    """A value of a (simple) JSON Schema: its first enum value, each property's, or its type's."""
    if not isinstance(schema, dict):
        return None
    if schema.get("enum"):
        return schema["enum"][0]
    if schema.get("type") == "object" or "properties" in schema:
        return {name: instance_of(sub) for name, sub in (schema.get("properties") or {}).items()}
    return {"string": "fake", "integer": 1, "number": 1.5, "boolean": True, "array": []}.get(schema.get("type"))
