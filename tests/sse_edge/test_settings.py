"""EdgeSettings from TOKENBUS_EDGE_* variables."""

import pytest
from pydantic import ValidationError

from tokenbus.sse_edge.settings import EdgeSettings


@pytest.mark.parametrize(("raw", "expected"), [("0", [0]), ("0,3", [0, 3]), ("8-11", [8, 9, 10, 11]),
                                               ("0-1, 5", [0, 1, 5])])
def test_reply_partitions_take_lists_and_ranges(monkeypatch, raw, expected):
    monkeypatch.setenv("TOKENBUS_EDGE_REPLY_PARTITIONS", raw)
    assert EdgeSettings().reply_partitions == expected


def test_reply_partitions_reject_words(monkeypatch):
    monkeypatch.setenv("TOKENBUS_EDGE_REPLY_PARTITIONS", "first")
    with pytest.raises(ValidationError):
        EdgeSettings()


def test_a_statefulset_replica_takes_its_reply_partitions_from_its_ordinal(monkeypatch):
    monkeypatch.setenv("TOKENBUS_EDGE_REPLY_PARTITIONS_PER_ORDINAL", "4")
    monkeypatch.setattr("socket.gethostname", lambda: "tokenbus-edge-2")
    assert EdgeSettings().reply_partitions == [8, 9, 10, 11]
    monkeypatch.setattr("socket.gethostname", lambda: "laptop")
    with pytest.raises(ValidationError, match="ordinal"):
        EdgeSettings()


def test_model_aliases_name_served_models_by_other_names(monkeypatch):
    monkeypatch.setenv("TOKENBUS_MODELS", "tokenbus-sim,ft:sim:org:1")
    monkeypatch.setenv("TOKENBUS_EDGE_MODEL_ALIASES", "gpt-4.1=tokenbus-sim, gpt-4o-mini=ft:sim:org:1")
    settings = EdgeSettings()
    assert settings.served_model("gpt-4o-mini") == "ft:sim:org:1"  # (a name with colons: `=` separates)
    assert settings.served_model("gpt-4.1") == "tokenbus-sim" and settings.served_model("other") == "other"
    for refused in ("gpt-4.1=no-such-model", "tokenbus-sim=ft:sim:org:1"):  # a model served by no one; a served name
        monkeypatch.setenv("TOKENBUS_EDGE_MODEL_ALIASES", refused)
        with pytest.raises(ValidationError, match="model alias"):
            EdgeSettings()
