"""What the rows of slot batching's KV cache keep for its prefix cache (the policy is hf_slots.py's
docstring): the blocks each row holds from position 0, named as blocks.py names them, the rows that
hold each block (``held``), and when each row was last used. Rows past the slots only keep
prefixes: no decode step reads or writes them, a copy does. The batcher's thread owns this; the
event loop reads ``held`` (membership only, safe while the thread changes it)."""

from __future__ import annotations

import itertools

from tokenbus.gpu_consumers.engines.blocks import block_hashes, leading_held
from tokenbus.gpu_consumers.engines.hf_slot_model import SlotModel


class SlotPrefixes:
    def __init__(self, model: SlotModel, block_tokens: int, slots: int, keeping_rows: int) -> None:
        self._model = model
        self.block_tokens = block_tokens
        self.held: dict[int, set[int]] = {}
        self._keeping = range(slots, slots + keeping_rows)
        self._blocks: list[tuple[int, ...]] = [()] * (slots + keeping_rows)
        self._used = [0] * (slots + keeping_rows)  # when each row's blocks were last written or read, on _uses' clock
        self._uses = itertools.count(1)

    @property
    def keeping_rows(self) -> range:
        return self._keeping

    def prefilled(self, slot: int, prompt: list[int], known: tuple[int, ...]) -> None:
        """``slot`` holds ``prompt``'s full blocks now (the names of the first ones ``known``)."""
        self._hold(slot, block_hashes(prompt, self.block_tokens, known=known))

    def released(self, slot: int, written: list[int] | None) -> None:
        """``slot``'s sequence ended, its cache holding ``written`` (its prompt's full blocks named
        already: the output's follow them); None: nothing it wrote can be trusted (a failed step)."""
        names = () if written is None else block_hashes(written, self.block_tokens, known=self._blocks[slot])
        self._hold(slot, names)

    def reuse(self, slot: int, wanted: tuple[int, ...], free: list[int]) -> int:
        """Where a prompt whose blocks before its last token are named ``wanted`` starts in ``slot``:
        past the leading blocks some row holds, its own slot's kept, another's copied in. What the
        slot held and no other row does is first moved aside to one of the ``free`` slots or the
        keeping rows."""
        size = self.block_tokens
        found = leading_held(wanted, self.held)
        own = self._blocks[slot]
        kept = leading_held(wanted[:found], set(own))
        source = min(self.held[wanted[found - 1]]) if found > kept else None
        if len(own) > kept and self.held[own[-1]] == {slot}:
            self._spill(slot, own, source, free)
        if source is not None:
            self._model.copy(source, slot, kept * size, found * size)
            self._used[source] = next(self._uses)
        self._hold(slot, wanted[:found])
        return found * size

    def _spill(self, slot: int, blocks: tuple[int, ...], source: int | None, free: list[int]) -> None:
        """Copy what ``slot`` holds, and no other row does, to the free slot or keeping row that
        matters least (not ``source``, which the new prompt copies from next): one holding nothing,
        else the one used longest ago."""
        spare = [s for s in (*free, *self._keeping) if s != source]
        if not spare:
            return
        target = min(spare, key=lambda s: (len(self._blocks[s]) > 0, self._used[s]))
        self._model.copy(slot, target, 0, len(blocks) * self.block_tokens)
        used = self._used[slot]
        self._hold(target, blocks)
        self._used[target] = used  # as old as it was: a spill is no use

    def _hold(self, row: int, after: tuple[int, ...]) -> None:
        """Row ``row`` now holds the blocks named ``after``, from position 0."""
        before = self._blocks[row]
        self._used[row] = next(self._uses)
        for name in set(before) - set(after):
            holders = self.held[name]
            holders.discard(row)
            if not holders:
                del self.held[name]
        for name in after:
            self.held.setdefault(name, set()).add(row)
        self._blocks[row] = after
