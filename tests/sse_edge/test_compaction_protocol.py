"""A compaction item's content (protocol/compaction.py): the summary round-trips, content this edge
did not make is refused naming the item, and a compaction reads as its summary's system message."""

import pytest

from tokenbus.sse_edge.errors import InvalidRequest
from tokenbus.sse_edge.protocol.compaction import SUMMARY_PREFIX, decode_summary, encode_summary
from tokenbus.sse_edge.protocol.responses import chat_messages, parse_items


def test_a_summary_round_trips_through_its_opaque_content():
    summary = "Ada likes tea; she asked about Paris (café, 20 €)."
    content = encode_summary(summary)
    assert content.startswith("tbc1.") and "Ada" not in content
    assert decode_summary(content) == summary
    for forged in ("gAAAAABo-openai", "tbc1.%%%", "tbc1." + "gA"):
        with pytest.raises(ValueError):
            decode_summary(forged)


def test_a_compaction_given_back_reads_as_the_system_message_of_its_summary():
    items = parse_items([{"role": "user", "content": "Hi."},
                         {"type": "compaction", "id": "cmp_1", "encrypted_content": encode_summary("Ada likes tea.")},
                         {"role": "user", "content": "And now?"}], "input")
    messages, sources = chat_messages(None, items)
    assert messages[1] == {"role": "system", "content": SUMMARY_PREFIX + "Ada likes tea."}
    assert sources == ["input[0]", "input[1]", "input[2]"]
    assert items[1].listed() == {"id": "cmp_1", "type": "compaction", "encrypted_content": items[1].encrypted_content}

    with pytest.raises(InvalidRequest) as refused:
        parse_items([{"role": "user", "content": "Hi."}, {"type": "compaction", "encrypted_content": "not ours"}],
                     "input")
    assert refused.value.param == "input[1].encrypted_content"
