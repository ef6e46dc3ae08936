"""The processors' faust app reads with the consumers its broker needs: on the embedded broker
faust's consumers wait at a hole in a partition's offsets like every other reader
(topics/holes.py), though faust makes them itself, not ``make_consumer``."""

import os
import subprocess
import sys

import pytest

PROBE = """
import aiokafka.consumer.fetcher as fetcher
from tokenbus.stream_processors.app import create_app
create_app()
print(fetcher.PartitionRecords.__name__)
"""


@pytest.mark.parametrize(("broker", "records"), [("embedded", "PartitionRecordsWaitingAtHoles"),
                                                 ("kafka", "PartitionRecords")])
def test_faust_reads_with_the_records_its_broker_needs(broker, records, tmp_path):
    # A process of its own: this one's readers have made the choice already.
    env = {**os.environ, "TOKENBUS_BROKER": broker, "TOKENBUS_BOOTSTRAP_SERVERS": "127.0.0.1:9",
           "TOKENBUS_PROC_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == records
