"""vLLM's ``bad_words``: words the output may not hold, read as vLLM reads them. Each word (less
its leading spaces) is tokenized as it is and with a space before it, the second kept only where
it is as many tokens with another first one (a word within a text is most tokenizers' other
token); a sequence's last token is then ruled out wherever the output's last tokens are the rest
of it, and a one-token word's everywhere. The output's tokens alone are looked at, not the
prompt's (vLLM's rule).

Every engine reads them with its own tokenizer (``bad_word_variants``) and applies them its way:
the simulated engine by ``banned_next``, the hf slot batching on the device (a one-token word in
its bias row, longer ones by hf_slot_bad_words.py), TensorRT-LLM as its own ``bad`` words."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any


def bad_word_variants(words: Iterable[str], encode: Callable[[str], Sequence[int]]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Each word's readings (text, token ids): as it is, and with a space before it where that is
    as long with another first token. A word ``encode`` makes nothing of is left out."""
    variants: list[tuple[str, tuple[int, ...]]] = []
    for word in words:
        text = word.lstrip()
        plain = tuple(encode(text))
        if not plain:
            continue
        variants.append((text, plain))
        spaced = tuple(encode(" " + text))
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            variants.append((" " + text, spaced))
    return tuple(variants)


def banned_next(sequences: Iterable[tuple[int, ...]], output: Sequence[int]) -> set[int]:
    """The tokens the next one may not be, after ``output``: each sequence's last where the output
    ends with the rest of it."""
    banned = set()
    for sequence in sequences:
        rest = len(sequence) - 1
        if rest == 0 or (len(output) >= rest and tuple(output[len(output) - rest:]) == sequence[:-1]):
            banned.add(sequence[-1])
    return banned


def token_bad_words(words: Iterable[str], tokenizer: Any,
                    vocabulary: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """``words`` as a transformers ``tokenizer`` reads them: the one-token words' ids, and the
    longer words' sequences. A word with a token the model cannot make (past ``vocabulary``) is left
    out: the output can never hold it."""
    read = [ids for _, ids in bad_word_variants(words, lambda text: tokenizer.encode(text, add_special_tokens=False))
            if max(ids) < vocabulary]
    return tuple(sorted({ids[0] for ids in read if len(ids) == 1})), tuple(ids for ids in read if len(ids) > 1)
