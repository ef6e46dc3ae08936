"""The simulated engine's words (engines/simulated.py): its vocabulary (a word's id is its place in
it), and how the next word is drawn: uniformly, as from equal logits, or, where a request asks for
something that reweighs them (a logit bias, OpenAI's presence and frequency penalties, vLLM's
repetition penalty, ``top_k``, ``min_p``, ``allowed_token_ids``, ``stop_token_ids`` held off by
``min_tokens``, vLLM's ``bad_words``), by ``drawn_weights``; and a drawn word's log probability
under the weights it was drawn from."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from tokenbus.gpu_consumers.engines.bad_words import bad_word_variants, banned_next
from tokenbus.gpu_consumers.engines.base import GenerationInput, SamplingParams
from tokenbus.schemas import TokenLogprob, TopLogprob, message_text

VOCABULARY = """
the bus carries every token from the engine to the edge and each event can be replayed so a
stream survives a crash without a gap or a duplicate while billing counts usage exactly once per
request for every tenant model and tier
""".split()


def reweighted(sampling: SamplingParams) -> bool:
    """Whether words are drawn by ``drawn_weights`` rather than uniformly."""
    return (sampling.penalized or bool(sampling.logit_bias) or bool(sampling.top_k) or bool(sampling.min_p)
            or sampling.repetition_penalty != 1 or bool(sampling.stop_token_ids and sampling.min_tokens)
            or bool(sampling.allowed_token_ids) or bool(sampling.bad_words))


@dataclass(slots=True)
class Said:
    """What a sequence's words are weighed against: how often its output holds each word (OpenAI's
    presence and frequency penalties count those), the places of the vocabulary's words its prompt
    holds (its repetition penalty counts both), its logit bias and allowed words, and its bad words
    (vLLM's, as word sequences, with the output's words in order), read once a sequence rather than
    once a word."""

    counts: dict[int, int] = field(default_factory=dict)
    prompt_words: frozenset[int] = frozenset()
    bias: dict[int, float] = field(default_factory=dict)
    allowed: frozenset[int] = frozenset()  # (empty: any)
    bad: tuple[tuple[int, ...], ...] = ()
    output: list[int] = field(default_factory=list)  # kept where there are bad words

    @classmethod
    def of(cls, inp: GenerationInput) -> Said:
        sampling = inp.sampling
        prompt_words: frozenset[int] = frozenset()
        if sampling.repetition_penalty != 1:
            words = {word for m in inp.messages for word in message_text(m).split()}
            prompt_words = frozenset(i for i, word in enumerate(VOCABULARY) if word in words)
        bad = tuple(ids for _, ids in bad_word_variants(sampling.bad_words, encode))
        return cls(prompt_words=prompt_words, bias=dict(sampling.logit_bias), allowed=frozenset(sampling.allowed_token_ids),
                   bad=bad)

    def add(self, token_id: int) -> None:
        self.counts[token_id] = self.counts.get(token_id, 0) + 1
        if self.bad:
            self.output.append(token_id)


def word_weights(sampling: SamplingParams, said: Said) -> list[float]:
    """Each word's weight against an unbiased word said nowhere yet: its logit (0) gains its
    ``logit_bias``, is divided by the repetition penalty where positive (multiplied where not) if
    the prompt or the output holds it, and loses the presence and frequency penalties where the
    output holds it: ``exp(logit - (presence + frequency * count))``; a word vLLM's
    ``allowed_token_ids`` leaves out, or its ``bad_words`` rule out next, weighs nothing."""
    presence, frequency, repetition = sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty
    bias, counts, allowed = said.bias, said.counts, said.allowed
    weights = []
    for i in range(len(VOCABULARY)):
        if allowed and i not in allowed:
            weights.append(0.0)
            continue
        logit = bias.get(i, 0.0)
        if repetition != 1 and (i in counts or i in said.prompt_words):
            logit = logit / repetition if logit > 0 else logit * repetition
        weights.append(math.exp(logit - (presence + frequency * counts[i] if i in counts else 0.0)))
    for banned in banned_next(said.bad, said.output) if said.bad else ():
        weights[banned] = 0.0
    return weights


def drawn_weights(sampling: SamplingParams, weights: list[float], generated: int) -> list[float]:
    """``word_weights`` as a draw uses them (a copy): vLLM's ``stop_token_ids`` left out while the
    output holds fewer than ``min_tokens`` words, then its ``top_k`` heaviest words kept (the first
    in VOCABULARY among equals) and those under ``min_p`` of the heaviest's weight left out."""
    weights = list(weights)
    if generated < sampling.min_tokens:
        for token_id in sampling.stop_token_ids:
            if token_id < len(weights):
                weights[token_id] = 0.0
    if sampling.top_k and sampling.top_k < len(weights):
        kept = set(sorted(range(len(weights)), key=lambda i: -weights[i])[:sampling.top_k])
        weights = [w if i in kept else 0.0 for i, w in enumerate(weights)]
    if sampling.min_p:
        floor = sampling.min_p * max(weights)
        weights = [w if w >= floor else 0.0 for w in weights]
    return weights


def next_weights(sampling: SamplingParams, said: Said) -> list[float] | None:
    """The weights the next word is drawn by (``word_weights``), made once a word for its draw and
    its log probability; None where words are drawn uniformly."""
    return word_weights(sampling, said) if reweighted(sampling) else None


def draw_word(rng: random.Random, sampling: SamplingParams, weights: list[float] | None, generated: int = 0) -> int:
    """The next word's place in VOCABULARY, after ``generated`` words: uniform, as from equal logits
    (``weights`` None), or by ``drawn_weights`` (biased, penalized or filtered), one draw of ``rng``."""
    if weights is None:
        return rng.randrange(len(VOCABULARY))
    return rng.choices(range(len(VOCABULARY)), drawn_weights(sampling, weights, generated))[0]


def word_logprob(sampling: SamplingParams, weights: list[float] | None, token_id: int, space: str) -> TokenLogprob:
    """The drawn word's log probability under the ``weights`` it was drawn with (None: uniform;
    before ``top_k`` and ``min_p``, as the hf slots' are before temperature and top-p), and the
    ``sampling.logprobs`` likeliest words (the first in VOCABULARY among equals). ``space``: what
    goes before each word where it is generated."""
    top = sampling.logprobs or 0
    if weights is None:
        logprob = -math.log(len(VOCABULARY))
        return TokenLogprob(space + VOCABULARY[token_id], logprob,
                            [TopLogprob(space + VOCABULARY[i], logprob) for i in range(top)])
    log_total = math.log(math.fsum(weights))

    def logprob_of(i: int) -> float:  # (-inf for a word ruled out)
        return math.log(weights[i]) - log_total if weights[i] > 0 else -math.inf

    likeliest = sorted(range(len(VOCABULARY)), key=lambda i: -weights[i])[:top]
    return TokenLogprob(space + VOCABULARY[token_id], logprob_of(token_id),
                        [TopLogprob(space + VOCABULARY[i], logprob_of(i)) for i in likeliest])


def prompt_logprobs(prompt: str, top: int, token_ids: tuple[int, ...] = ()) -> tuple[TokenLogprob, ...]:
    """A text prompt's tokens (a word each, with the space before it: the simulated tokenizer's,
    simulated_prompts.py; given as ``token_ids``, a token each, named as the word of its place in
    VOCABULARY, or ``<id>`` past it) scored as the simulated model sees them: the first unscored (0,
    no top), each later one uniform among VOCABULARY's words where it is one and ruled out (-inf)
    where not, with the first ``top`` words as the likeliest."""
    uniform = -math.log(len(VOCABULARY))
    likeliest = [TopLogprob(" " + word, uniform) for word in VOCABULARY[:top]]
    if token_ids:
        tokens = [(" " + VOCABULARY[i], True) if i < len(VOCABULARY) else (f"<{i}>", False) for i in token_ids]
    else:
        tokens = [(token, token.strip() in VOCABULARY) for token in re.findall(r"\s*\S+", prompt)]
    return tuple(TokenLogprob(token, 0.0) if i == 0 else TokenLogprob(token, uniform if said else -math.inf, likeliest)
                 for i, (token, said) in enumerate(tokens))


def encode(text: str) -> list[int]:
    """``text``'s words as the vocabulary's (none where one is not a word of it: never generated)."""
    words = text.split()
    return [VOCABULARY.index(w) for w in words] if all(w in VOCABULARY for w in words) else []


def decode(token_ids: tuple[int, ...] | list[int]) -> str:
    return " ".join(VOCABULARY[t] for t in token_ids)
