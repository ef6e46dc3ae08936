"""The key endpoints on the running edge: a key sees itself and its quota; a tenant admin key
lists, creates and revokes its tenant's keys and no other tenant's; nothing shows a secret
but the answer that makes it."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.conftest import MODEL, SLOW_MODEL
from tests.stream_processors.helpers import eventually
from tokenbus.stores.keys import Limits

pytestmark = pytest.mark.stack


def tenant() -> str:
    return f"keys-{uuid.uuid4().hex[:8]}"


async def call(stack, key: str, method: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.edge_url, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"}) as http:
        return await http.request(method, path, **kwargs)


async def test_a_key_sees_its_limits_and_what_is_left_of_them(stack):
    # 5 a minute: the bucket gives one back every 12 s, so the request below still shows in what is
    # left after it, however long it takes (at 50 a minute, a busy machine refilled it meanwhile).
    key = await stack.create_key(tenant(), "standard", limits=Limits(rpm=5, tpm=0))
    before = (await call(stack, key, "GET", "/v1/keys/self")).json()
    assert before["object"] == "api_key" and before["tier"] == "standard" and not before["admin"]
    assert before["quota"]["key"]["requests_per_minute"] == 5 and before["quota"]["key"]["tokens_per_minute"] is None
    assert 4 <= before["quota"]["key"]["remaining_requests"] <= 5
    answered = await call(stack, key, "POST", "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "count me"}]})
    assert answered.status_code == 200
    after = (await call(stack, key, "GET", "/v1/keys/self")).json()
    assert after["quota"]["key"]["remaining_requests"] < before["quota"]["key"]["remaining_requests"]
    assert "key" not in after and "key_hash" not in after


async def test_a_turns_completion_tokens_come_off_its_token_limit_once_it_ends(stack):
    # 120 a minute: two come back a second, so 60 completion tokens show however long the check takes.
    key = await stack.create_key(tenant(), "standard", limits=Limits(rpm=0, tpm=120))
    answered = await call(stack, key, "POST", "/v1/chat/completions",
                          json={"model": SLOW_MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "go"}]})
    assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 60

    async def charged() -> int | None:
        left = (await call(stack, key, "GET", "/v1/keys/self")).json()["quota"]["key"]["remaining_tokens"]
        return left if left <= 120 - 60 + 10 else None  # within 5 s of refill of the 60

    assert await eventually(charged, timeout=10) >= 120 - 60 - 30  # the prompt came off too, nothing more


async def test_only_a_tenant_admin_key_manages_keys(stack):
    key = await stack.create_key(tenant(), "standard")
    for method, path in [("GET", "/v1/keys"), ("POST", "/v1/keys"), ("DELETE", "/v1/keys/0123456789ab")]:
        refused = await call(stack, key, method, path)
        assert refused.status_code == 403, (method, path)
        assert refused.json()["error"]["code"] == "admin_key_required"


async def test_an_admin_creates_lists_and_revokes_and_the_revoked_key_is_refused(stack):
    admin = await stack.create_key(tenant(), "standard", admin=True)
    made = await call(stack, admin, "POST", "/v1/keys", json={"rpm": 30, "models": [MODEL]})
    assert made.status_code == 201
    new = made.json()
    assert new["key"].startswith("tb-") and new["tier"] == "standard" and new["models"] == [MODEL]
    assert new["rpm"] == 30 and not new["admin"]
    assert (await call(stack, new["key"], "GET", "/v1/models")).status_code == 200

    listed = (await call(stack, admin, "GET", "/v1/keys")).json()["data"]
    assert {k["id"] for k in listed} == {new["id"], (await call(stack, admin, "GET", "/v1/keys/self")).json()["id"]}
    assert all("key" not in k and "key_hash" not in k for k in listed)

    revoked = await call(stack, admin, "DELETE", f"/v1/keys/{new['id']}")
    assert revoked.json() == {"id": new["id"], "object": "api_key", "revoked": True}
    refused = await call(stack, new["key"], "GET", "/v1/models")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert [k["revoked"] for k in (await call(stack, admin, "GET", "/v1/keys")).json()["data"] if k["id"] == new["id"]] \
        == [True]


async def test_an_admin_never_reaches_another_tenant_s_keys(stack):
    key_of_a = await stack.create_key(tenant(), "standard")
    a_id = (await call(stack, key_of_a, "GET", "/v1/keys/self")).json()["id"]
    admin_of_b = await stack.create_key(tenant(), "standard", admin=True)
    assert a_id not in {k["id"] for k in (await call(stack, admin_of_b, "GET", "/v1/keys")).json()["data"]}
    for key_id in (a_id, "not-a-key-id", "0123456789ab"):
        missing = await call(stack, admin_of_b, "DELETE", f"/v1/keys/{key_id}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "key_not_found"
    assert (await call(stack, key_of_a, "GET", "/v1/models")).status_code == 200


async def test_an_admin_gives_no_more_than_it_has(stack):
    admin = await stack.create_key(tenant(), "standard", models=(MODEL,), admin=True)
    cases = [
        ({"tier": "interactive"}, 403, "tier_not_allowed", "tier"),
        ({"tier": "premium"}, 404, "tier_not_found", "tier"),
        ({"models": [SLOW_MODEL]}, 403, "model_not_allowed", "models"),
        ({"models": ["no-such-model"]}, 404, "model_not_found", "models"),
        ({"rpm": -1}, 400, None, "rpm"),
        ({"admin": True}, 400, None, "admin"),
    ]
    for body, status, code, param in cases:
        refused = await call(stack, admin, "POST", "/v1/keys", json=body)
        assert refused.status_code == status, body
        error = refused.json()["error"]
        assert error["param"] == param and (code is None or error["code"] == code), (body, error)
    lower = await call(stack, admin, "POST", "/v1/keys", json={"tier": "batch"})
    assert lower.status_code == 201 and lower.json()["tier"] == "batch" and lower.json()["models"] == [MODEL]
    bad_json = await call(stack, admin, "POST", "/v1/keys", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
