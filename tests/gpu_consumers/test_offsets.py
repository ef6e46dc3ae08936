from aiokafka import TopicPartition

from tokenbus.gpu_consumers.offsets import OffsetTracker

TP = TopicPartition("t", 0)


def test_commits_stop_below_the_oldest_unfinished_request():
    tracker = OffsetTracker()
    for offset in (10, 11, 12):
        tracker.started(TP, offset)
    tracker.finished(TP, 11)
    tracker.finished(TP, 12)
    assert tracker.committable() == {TP: 10}
    tracker.mark_committed({TP: 10})
    assert tracker.committable() == {}
    tracker.finished(TP, 10)
    assert tracker.committable() == {TP: 13}


def test_forget_drops_revoked_partitions():
    tracker = OffsetTracker()
    tracker.started(TP, 0)
    tracker.forget({TP})
    assert tracker.committable() == {} and tracker.in_flight(TP) == 0
