"""What a record says of itself beyond its fields."""

from tokenbus.schemas import ChatMessage, ChatRequest


def request(**fields) -> ChatRequest:
    return ChatRequest("chatcmpl-1", "m", "standard", [ChatMessage("user", "hi")], "tokens", 0, **fields)


def test_a_request_is_keyed_by_its_prompt_cache_key_then_its_conversation_then_itself():
    assert request().partition_key == "chatcmpl-1"
    assert request(conversation_id="c-1").partition_key == "c-1"
    # The cache key comes first, scoped by tenant: two tenants' keys named alike are keys apart.
    assert request(tenant="acme", conversation_id="c-1", prompt_cache_key="agent").partition_key == "acme/agent"
    assert request(tenant="umbrella", prompt_cache_key="agent").partition_key == "umbrella/agent"
    assert request(conversation_id="c-1", prompt_cache_key="").partition_key == "c-1"
