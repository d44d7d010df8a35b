"""``StepRowCache``: the rows a policy rank fetched or wrote in this step, kept so the train call need not fetch them.

A data-plane step fetches a rank's ``input_ids`` for the log-prob call and
computes log-probs; the train call of the same step then needs those same
rows again. The rank keeps them, as the rank batch had them (token fields
padded to the step's pad length), in *blocks* of rows; a later fetch of
cached ``(key, field)`` pairs gathers them here and reads only the rest from
the store. Log-probs of rows the rank will train on itself are kept here
only (the step's ``keep``): the store never holds them, and the train call
reads them from this cache.

Invariants:
  * a cached row equals what a store round trip gives for it: fetched rows
    are kept as read, and computed rows as the store round trip would give
    them back (trimmed to each row's length, then zero-padded to the pad
    length: :func:`core.codec.repad`, equal to the codec's
    :func:`core.codec.to_jagged` then :func:`core.codec.to_padded`), whether
    or not they were written;
  * rows are looked up by key and the step's pad length: a row cached under
    another pad length is a miss;
  * the cache holds at most ``max_blocks`` blocks (oldest dropped first); the
    worker empties it when a log-prob call starts and after each train call.

It is safe because a step's keys are unique to the step and each ``(key,
field)`` has exactly one writer, the replica leader, whose computed values
every rank of its replica group holds alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from core.codec import repad


@attrs.define
class _Block:
    positions: dict[str, int]
    pad: int
    columns: dict[str, torch.Tensor]


class StepRowCache:
    """Rows of this step by ``(key, field)`` (see the module docstring).

    Args:
        max_blocks: how many blocks (fetches or writes of distinct key lists) to keep.
    """

    def __init__(self, max_blocks: int = 4) -> None:
        if max_blocks < 1:
            raise ValueError(f"'max_blocks' must be >= 1: got {max_blocks}")
        self.max_blocks = max_blocks
        self._blocks: list[_Block] = []

    def __len__(self) -> int:
        """The number of blocks held."""
        return len(self._blocks)

    def clear(self) -> None:
        """Drop every row."""
        self._blocks = []

    def remember_fetched(self, keys: Sequence[str], columns: Mapping[str, torch.Tensor], pad: int) -> None:
        """Keep rows as a fetch returned them (``[B, ...]``, token fields already padded to ``pad``)."""
        self._remember(keys, dict(columns), pad)

    def remember_written(
        self, keys: Sequence[str], columns: Mapping[str, torch.Tensor], lengths: Sequence[int], pad: int
    ) -> None:
        """Keep per-token rows ``[B, S, ...]`` as a fetch would return them after the write: trimmed to ``lengths``,
        zero-padded to ``pad``."""
        self._remember(keys, {name: repad(value, lengths, pad_to_length=pad) for name, value in columns.items()}, pad)

    def split(self, keys: Sequence[str], fields: Sequence[str], pad: int) -> tuple[list[int], list[int]]:
        """Positions in ``keys`` whose every field is cached under ``pad`` (hits), and the others (misses)."""
        held = [True] * len(keys)
        for name in fields:
            for i, where in enumerate(self._locate(keys, name, pad)):
                if where is None:
                    held[i] = False
        return [i for i, found in enumerate(held) if found], [i for i, found in enumerate(held) if not found]

    def gather(self, keys: Sequence[str], fields: Sequence[str], pad: int) -> dict[str, torch.Tensor]:
        """``fields`` of ``keys`` (all hits), in ``keys`` order.

        Raises:
            ValueError: ``keys`` is empty (a gather of no rows has no shape to give).
            KeyError: a ``(key, field)`` is not cached under ``pad``.
        """
        if not keys:
            raise ValueError("'keys' must name at least one row to gather: got none")
        out = {}
        for name in fields:
            picks = []
            for key, found in zip(keys, self._locate(keys, name, pad)):
                if found is None:
                    raise KeyError(f"row {key!r} field {name!r} is not cached at pad length {pad}")
                picks.append(found)
            blocks = {b for b, _ in picks}
            if len(blocks) == 1:
                column = self._blocks[blocks.pop()].columns[name]
                out[name] = column.index_select(0, torch.tensor([p for _, p in picks], dtype=torch.long))
            else:
                out[name] = torch.stack([self._blocks[b].columns[name][p] for b, p in picks])
        return out

    def _locate(self, keys: Sequence[str], name: str, pad: int) -> list[tuple[int, int] | None]:
        """Per key, ``(block, row)`` of its latest cached row of ``name`` under ``pad``, or None: one pass over the
        keys per block that holds the field, newest block first, over only the keys not found yet."""
        found: list[tuple[int, int] | None] = [None] * len(keys)
        left: Sequence[int] = range(len(keys))
        for b in range(len(self._blocks) - 1, -1, -1):  # the latest block wins
            block = self._blocks[b]
            if block.pad != pad or name not in block.columns:
                continue
            positions, still = block.positions, []
            for i in left:
                row = positions.get(keys[i])
                if row is None:
                    still.append(i)
                else:
                    found[i] = (b, row)
            left = still
            if not left:
                break
        return found

    def _remember(self, keys: Sequence[str], columns: dict[str, torch.Tensor], pad: int) -> None:
        keys = list(keys)
        for block in self._blocks:
            if block.pad == pad and list(block.positions) == keys:  # the same rows: one block, more fields
                block.columns.update(columns)
                return
        self._blocks.append(_Block({key: i for i, key in enumerate(keys)}, pad, columns))
        del self._blocks[: -self.max_blocks]
