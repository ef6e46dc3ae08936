"""The incremental detokenizer against a real byte-level BPE tokenizer: the deltas it streams
join to exactly what decoding the whole sequence gives, however the tokens are grouped into
steps, split characters included, and a taken-over sequence continues without repeating text.
Each runs twice: through tokenizers' Rust ``DecodeStream`` (a fast tokenizer) and through
``WindowDecodeStream``, its Python twin, for a tokenizer that only has ``decode``."""

from __future__ import annotations

import random

import pytest

from tokenbus.gpu_consumers.engines.detokenize import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopFilter,
    WindowDecodeStream,
    rust_tokenizer,
)

TEXTS = [
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "héllo wörld — streams survive a crashed worker ✓ 東京 🚀 done",
    "  leading spaces,\nnew lines\n\tand tabs  ",
]


class DecodeOnly:
    """A tokenizer with no Rust backend to find: only ``decode`` (and ``encode`` for the tests)."""

    def __init__(self, tokenizer) -> None:
        self.encode, self.decode = tokenizer.encode, tokenizer.decode


@pytest.fixture
def fast_tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture(params=["rust", "python"])
def tokenizer(request, fast_tokenizer):
    return fast_tokenizer if request.param == "rust" else DecodeOnly(fast_tokenizer)


def steps(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        out.append(ids[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deltas_join_to_the_full_decode(tokenizer, text, seed):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(step) for step in steps(ids, random.Random(seed))]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert detokenizer.token_ids == ids


def test_a_split_character_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE with a tiny vocabulary splits the emoji's bytes
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == "🚀"


@pytest.mark.parametrize("held", [0, 1, 3])
def test_a_taken_over_sequence_continues_after_what_was_sent(tokenizer, held):
    """Cut after every token, split characters included (the cut token's bytes gave out no text
    yet), with the last ``held`` characters sent held back: the successor gives out the rest."""
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    splits = 0
    for cut in range(len(ids) + 1):
        first = IncrementalDetokenizer(tokenizer)
        sent = "".join(first.push([i]) for i in ids[:cut])
        splits += tokenizer.decode(ids[:cut]).endswith(REPLACEMENT_CHAR)
        sent = sent[:max(len(sent) - held, 0)]
        second = IncrementalDetokenizer(tokenizer, tuple(ids[:cut]), sent)
        rest = "".join(second.push([i]) for i in ids[cut:]) + second.flush()
        assert sent + rest == whole, f"cut after {cut} of {len(ids)} tokens"
    assert splits >= 3, "the text should split characters across tokens"


def test_work_per_step_does_not_grow_with_the_output(tokenizer):
    ids = tokenizer.encode(TEXTS[0] * 30, add_special_tokens=False)
    decoded_lengths: list[int] = []

    class Counting:
        def decode(self, token_ids, skip_special_tokens=False):
            decoded_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    detokenizer = IncrementalDetokenizer(Counting())
    assert isinstance(detokenizer._stream, WindowDecodeStream)
    for i in ids:
        detokenizer.push([i])
    assert len(ids) > 300
    assert max(decoded_lengths) <= IncrementalDetokenizer.MAX_SPLIT_TOKENS + 1


def test_the_rust_stream_is_used_wherever_a_fast_tokenizer_can_be_found(fast_tokenizer):
    class TensorRtLlmWrapper:  # tensorrt_llm.llmapi.tokenizer.TransformersTokenizer keeps it as .tokenizer
        def __init__(self, tokenizer) -> None:
            self.tokenizer = tokenizer

    backend = fast_tokenizer.backend_tokenizer
    assert rust_tokenizer(fast_tokenizer) is backend
    assert rust_tokenizer(TensorRtLlmWrapper(fast_tokenizer)) is backend
    assert rust_tokenizer(DecodeOnly(fast_tokenizer)) is None
    fast_tokenizer.clean_up_tokenization_spaces = True  # decode() then edits the text the backend gives
    try:
        assert rust_tokenizer(fast_tokenizer) is None
    finally:
        fast_tokenizer.clean_up_tokenization_spaces = False


def test_the_python_stream_gives_out_what_the_rust_one_does_step_for_step(fast_tokenizer):
    from tokenizers.decoders import DecodeStream

    ids = fast_tokenizer.encode("".join(TEXTS), add_special_tokens=False)
    for primed in (0, 3, 9):
        rust = DecodeStream(ids[:primed], skip_special_tokens=True)
        python = WindowDecodeStream(ids[:primed], skip_special_tokens=True)
        backend = fast_tokenizer.backend_tokenizer
        steps = [(rust.step(backend, i), python.step(fast_tokenizer, i)) for i in ids[primed:]]
        assert [r for r, _ in steps] == [p for _, p in steps]
        assert None in [r for r, _ in steps]  # split characters were held back on the way


def test_a_window_that_decodes_differently_starts_afresh():
    """Some tokenizers' decoding is not monotonic: a window's text need not start with its
    context's. The stream starts a fresh window rather than failing the sequence (vLLM does too)."""

    class Ligature:
        def decode(self, ids, skip_special_tokens=False):
            return "Xyz" if ids[-2:] == [7, 8] else "".join({7: "a", 8: "bb", 9: "c"}[i] for i in ids)

    detokenizer = IncrementalDetokenizer(Ligature())
    assert [detokenizer.push([i]) for i in (7, 8, 9)] == ["a", "bb", "c"]


@pytest.mark.parametrize("text", TEXTS[1:2])
def test_tokens_pushed_at_once_give_out_what_one_at_a_time_would(tokenizer, text):
    """A reader that fell behind its engine pushes several tokens at once, the last of which may
    start a character still split. What those tokens complete comes out now, as it would have one
    by one: held back until a later push, the last step of a sequence lost it (its final step has
    no later push)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    for cut in range(2, len(ids)):
        one_by_one = IncrementalDetokenizer(tokenizer)
        singly = "".join(one_by_one.push([i]) for i in ids[:cut])
        at_once = IncrementalDetokenizer(tokenizer)
        split = max(cut - 4, 0)  # the last (up to) four tokens come in one push
        head = at_once.push(ids[:split]) if split else ""
        assert head + at_once.push(ids[split:cut]) == singly, f"cut after {cut} of {ids}"


def test_a_stop_filter_holds_back_only_what_could_still_become_a_stop():
    without = StopFilter(())
    assert [without.feed(d) for d in ("ab", "c")] == [("ab", False), ("c", False)] and without.flush() == ""
    stops = StopFilter(("END",))
    assert [stops.feed(d) for d in ("abE", "N", "D!")] == [("a", False), ("b", False), ("", True)]
    stops = StopFilter(("END",))
    assert stops.feed("xEN") == ("x", False) and stops.flush() == "EN"  # the sequence ended first


def test_the_stop_met_first_ends_the_text_before_it_or_after_it_where_kept():
    """Two stops in one delta: the one that ends first is the one a token-by-token feed meets
    first; with ``keep_stop`` (vLLM's ``include_stop_str_in_output``) the text goes through it."""
    for keep, want in ((False, "xa"), (True, "xabc")):
        stops = StopFilter(("bc", "abcd"), keep_stop=keep)
        assert stops.feed("x") == ("", False)  # (a stop of four characters: the last three are held back)
        assert stops.feed("abcdef") == (want, True)
