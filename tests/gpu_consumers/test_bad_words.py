"""How vLLM's bad words are read (engines/bad_words.py), without an engine: a word's readings as a
tokenizer makes them, and the tokens the next one may not be after an output."""

from tokenbus.gpu_consumers.engines.bad_words import bad_word_variants, banned_next

# A tokenizer whose word within a text ("▁" before it) is another token than the word at the start.
TOKENS = {"red": 1, "▁red": 2, "bus": 3, "▁bus": 4, "blue": 5}


def encode(text: str) -> list[int]:
    return [TOKENS.get("▁" + word, TOKENS[word]) if i else TOKENS[word]
            for i, word in enumerate(text.split(" ")) if word]


def test_a_word_is_read_as_it_is_and_with_a_space_before_it_where_that_is_another_token():
    assert bad_word_variants(["red bus"], encode) == (("red bus", (1, 4)), (" red bus", (2, 4)))
    assert bad_word_variants(["  red"], encode) == (("red", (1,)), (" red", (2,)))
    assert bad_word_variants(["blue"], encode) == (("blue", (5,)),)  # no other token with a space: one reading
    assert bad_word_variants(["unknown"], lambda text: []) == ()


def test_a_word_s_last_token_is_banned_where_the_output_ends_with_the_rest_of_it():
    words = [(1, 4), (2, 4), (5,)]
    assert banned_next(words, []) == {5}  # a one-token word: always
    assert banned_next(words, [3, 1]) == {4, 5}
    assert banned_next(words, [1, 3]) == {5}
    assert banned_next(words, [2]) == {4, 5}
