from aiokafka import TopicPartition

from tokenbus.gpu_consumers.scheduler import Pending, TierScheduler
from tokenbus.schemas import ChatMessage, ChatRequest

TIERS = ["interactive", "standard", "batch"]
WEIGHTS = {"interactive": 16, "standard": 4, "batch": 1}


def pending(i: int, tier: str, tenant: str = "t", partition: int = 0) -> Pending:
    request = ChatRequest(f"{tier}-{tenant}-{i}", "m", tier, [ChatMessage("user", "x")], "tokens", 0, tenant=tenant)
    return Pending(request, TopicPartition(f"requests.m.{tier}", partition), i)


def drain(scheduler: TierScheduler, count: int) -> list[Pending]:
    return [scheduler.pop() for _ in range(count)]


def test_higher_tiers_first_in_proportion_to_weights():
    scheduler = TierScheduler(TIERS, WEIGHTS)
    for tier in reversed(TIERS):  # arrival order must not matter
        for i in range(100):
            scheduler.add(pending(i, tier))
    first = drain(scheduler, 21)
    tiers = [p.request.tier for p in first]
    assert tiers[:4] == ["interactive"] * 4  # standard (weight 4) comes in once per four interactive
    assert tiers.index("batch") == 20
    assert tiers.count("interactive") == 16 and tiers.count("standard") == 4 and tiers.count("batch") == 1


def test_lower_tier_is_never_starved():
    scheduler = TierScheduler(TIERS, WEIGHTS)
    scheduler.add(pending(0, "batch"))
    for i in range(1000):
        scheduler.add(pending(i, "interactive"))
    order = [p.request.tier for p in drain(scheduler, 17)]
    assert "batch" in order


def test_an_idle_tier_earns_no_burst():
    scheduler = TierScheduler(TIERS, WEIGHTS)
    for i in range(200):
        scheduler.add(pending(i, "batch"))
    drain(scheduler, 150)  # batch alone for a long time
    for i in range(50):
        scheduler.add(pending(i, "interactive"))
    order = [p.request.tier for p in drain(scheduler, 17)]
    assert order.count("interactive") == 16


def test_tenants_take_turns_within_a_tier():
    scheduler = TierScheduler(TIERS, WEIGHTS)
    for i in range(50):
        scheduler.add(pending(i, "standard", tenant="flood"))
    for i in range(3):
        scheduler.add(pending(i, "standard", tenant="quiet"))
    order = [p.tenant for p in drain(scheduler, 6)]
    assert order == ["flood", "quiet"] * 3
    assert scheduler.waiting("standard") == 47


def test_remove_by_id_and_by_partition():
    scheduler = TierScheduler(TIERS, WEIGHTS)
    for i in range(4):
        scheduler.add(pending(i, "standard", partition=i % 2))
    assert scheduler.remove("standard-t-1").offset == 1
    assert scheduler.remove("standard-t-1") is None
    removed = scheduler.remove_partitions([TopicPartition("requests.m.standard", 0)])
    assert sorted(p.offset for p in removed) == [0, 2]
    assert scheduler.waiting() == 1 and scheduler.pop().offset == 3 and scheduler.pop() is None
