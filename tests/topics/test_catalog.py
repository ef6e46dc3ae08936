
from aiokafka.admin import AIOKafkaAdminClient

from tests.conftest import unique_prefix
from tokenbus.topics import BusSettings, TopicCatalog, ensure_topics, topic_safe


def test_names_follow_prefix_model_and_tier():
    catalog = TopicCatalog(BusSettings(topic_prefix="tb.", models=["org/Model 7B"], tiers=["gold", "bronze"]))
    assert catalog.requests("org/Model 7B", "gold") == "tb.requests.org_Model_7B.gold"
    assert catalog.model_request_topics("org/Model 7B") == ["tb.requests.org_Model_7B.gold", "tb.requests.org_Model_7B.bronze"]
    assert catalog.tier_of("tb.requests.org_Model_7B.bronze", "org/Model 7B") == "bronze"
    assert catalog.tier_of("tb.tokens", "org/Model 7B") is None
    assert {catalog.tokens, catalog.control, catalog.completions, catalog.dlq, catalog.ingress} <= {
        spec.name for spec in catalog.all_topics()
    }


def test_rolled_reply_logs_are_named_by_router_and_time_and_told_apart_from_other_topics():
    catalog = TopicCatalog(BusSettings(topic_prefix="tb."))
    name = catalog.rolled_reply_log("ab12", 1_795_000_000_123)
    assert name == "tb.tokens.ab12.1795000000123"
    assert catalog.parse_rolled_reply_log(name) == ("ab12", 1_795_000_000_123)
    assert catalog.is_reply_log(name) and catalog.is_reply_log(catalog.tokens)
    for other in (catalog.tokens, catalog.completions, "tb.tokens.ab12", "tb.tokens.ab12.x", "tb.tokens..5", "xx.tokens.a.1"):
        assert catalog.parse_rolled_reply_log(other) is None
    assert not catalog.is_reply_log(catalog.control)


def test_topic_safe_keeps_only_legal_characters():
    assert topic_safe("a.b/c:d e") == "a_b_c_d_e"
    assert topic_safe("ok-name_1") == "ok-name_1"


def test_settings_read_comma_separated_environment(monkeypatch):
    monkeypatch.setenv("TOKENBUS_MODELS", "a, b")
    monkeypatch.setenv("TOKENBUS_TIERS", "hi,lo")
    settings = BusSettings()
    assert settings.models == ["a", "b"] and settings.tiers == ["hi", "lo"]


def test_the_express_lane_is_switched_by_its_name_or_its_first_one(monkeypatch):
    assert BusSettings().express_lane
    monkeypatch.setenv("TOKENBUS_EXPRESS_FIRST_TOKEN", "false")
    assert not BusSettings().express_lane
    monkeypatch.setenv("TOKENBUS_EXPRESS_LANE", "true")  # the current name wins
    assert BusSettings().express_lane
    assert not BusSettings(express_lane=False).express_lane  # and code passes it by name


def test_a_kafka_cluster_gets_replicated_topics_with_retention_and_the_embedded_broker_plain_ones():
    kafka = {spec.name.removeprefix("tb."): spec for spec in TopicCatalog(BusSettings(topic_prefix="tb.")).all_topics()}
    assert {spec.replicas for spec in kafka.values()} == {3}
    assert {spec.config["min.insync.replicas"] for spec in kafka.values()} == {"2"}
    assert kafka["tokens"].config["retention.ms"] == str(24 * 3600 * 1000)  # as long as streams resume
    assert kafka["completions"].config["retention.ms"] == str(7 * 24 * 3600 * 1000)  # billing replays
    embedded = TopicCatalog(BusSettings(topic_prefix="tb.", broker="embedded")).all_topics()
    assert {(spec.replicas, len(spec.config)) for spec in embedded} == {(1, 0)}


async def test_provisioning_is_idempotent_with_explicit_partitions(stack):
    # Kafka's topic settings, at the one replica the embedded broker has: configs go with the create.
    settings = BusSettings(bootstrap_servers=stack.bootstrap_servers, topic_prefix=unique_prefix(),
                           token_partitions=6, request_partitions=3, replication_factor=1)
    specs = TopicCatalog(settings).all_topics()
    created = await ensure_topics(settings.bootstrap_servers, specs)
    assert sorted(created) == sorted(spec.name for spec in specs)
    assert await ensure_topics(settings.bootstrap_servers, specs) == []

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        described = await admin.describe_topics([spec.name for spec in specs])
    finally:
        await admin.close()
    partitions = {d["topic"]: len(d["partitions"]) for d in described}
    assert partitions == {spec.name: spec.partitions for spec in specs}
    assert partitions[TopicCatalog(settings).tokens] == 6



async def test_provisioners_racing_for_the_same_topics_both_succeed(stack, monkeypatch):
    """Both list the topics as missing and both ask to create them: the one that comes second is
    answered TOPIC_ALREADY_EXISTS, which is success, where any other refusal is an error. The
    second's listing is made to come before the first's creation (left to chance, it often came
    after, and then the second asked for nothing)."""
    specs = TopicCatalog(BusSettings(topic_prefix=unique_prefix(), broker="embedded")).all_topics()
    first = await ensure_topics(stack.bootstrap_servers, specs)

    async def listed_before_the_first_created(self: AIOKafkaAdminClient) -> list[str]:
        return []

    monkeypatch.setattr(AIOKafkaAdminClient, "list_topics", listed_before_the_first_created)
    second = await ensure_topics(stack.bootstrap_servers, specs)
    assert sorted(first) == sorted(second) == sorted(spec.name for spec in specs)
