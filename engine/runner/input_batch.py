"""The runner's persistent batch: each live request keeps a row, its block table and its next position in it, from
step to step.

A batch carries only what changed since the batches before it (`ScheduledRequest.block_offset`: the blocks from
there on; `Batch.decode`: plain decode rows as columns, with positions only where they moved; `Batch.dropped`: the
requests whose rows may go), so a decode step's block tables and positions are a gather of rows already in place, not
a copy of every request's state.
"""

from __future__ import annotations

import numpy as np

from engine.core.batch import Batch, DecodeRows


class BlockTableGap(RuntimeError):
    """A batch's blocks start past the end of what this runner holds of the request: a batch before it never got here."""


class PositionUnknown(RuntimeError):
    """A decode row without a position for a request whose next position this runner does not hold."""


class InputBatch:
    """Rows of block tables by request, kept between steps. Every row past a request's blocks holds zeros, so a gather
    of rows is exactly the padded table a fresh build from whole tables gives."""

    def __init__(self, max_blocks: int, capacity: int = 8):
        self.max_blocks = max_blocks
        self.block_tables = np.zeros((capacity, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int32)  # per row, for the batch's width in one gather
        self.lengths = [0] * capacity  # the same, read per request per step without a numpy scalar
        # Each row's next position: after the last row a batch brought it (-1: none yet).
        self.next_positions = np.full(capacity, -1, dtype=np.int64)
        # The positions of the decode rows (Batch.decode) of the batch applied last.
        self.decode_positions = np.zeros(0, dtype=np.int64)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(capacity - 1, -1, -1))
        # The batch applied last and its rows: prepare may see one batch twice (a test, a re-run), and a diff applies
        # once.
        self._last: tuple[Batch, list[int], np.ndarray] | None = None

    def apply(self, batch: Batch) -> list[int]:
        """Drop the rows `batch` releases, write the blocks and positions it brings; returns each of its rows' row
        here (those of `batch.requests`, then those of `batch.decode`), and leaves the decode rows' positions in
        `decode_positions`."""
        last = self._last
        if last is not None and last[0] is batch:
            self.decode_positions = last[2]
            return last[1]
        for request_id in batch.dropped:
            self._drop(request_id)
        rows, lengths, get = [], self.lengths, self.rows.get
        # Per request per step, for rows other than plain decodes: a lookup and a comparison where no block comes.
        for sr in batch.requests:
            row = get(sr.request_id)
            if row is None:
                row = self._take(sr.request_id)
            blocks, offset = sr.block_table, sr.block_offset
            if blocks or offset != lengths[row]:
                self._write(row, offset, blocks, sr.request_id)
            self.next_positions[row] = sr.num_computed_tokens + len(sr.token_ids)  # (it grows with the rows)
            rows.append(row)
        d = batch.decode
        if d.request_ids:
            rows += self._apply_decode(d)
        else:
            self.decode_positions = np.zeros(0, dtype=np.int64)
        positions = self.decode_positions
        self._last = batch, rows, positions
        return rows

    def _apply_decode(self, d: DecodeRows) -> list[int]:
        """The columns of plain decode rows: writes their blocks, sets `decode_positions`; returns their rows."""
        ids = d.request_ids
        rows = list(map(self.rows.get, ids))
        if None in rows:  # new here (a request back after a preemption whose tokens were all cached but one)
            rows = [self._take(rid) if row is None else row for rid, row in zip(ids, rows)]
        for i, offset, blocks in zip(d.grown, d.block_offsets, d.blocks):
            self._write(rows[i], offset, blocks, ids[i])
        index = np.array(rows, dtype=np.intp)
        positions = self.next_positions[index]
        if d.moved:
            positions[d.moved] = d.positions
        if positions.min() < 0:
            rid = ids[int(np.argmin(positions))]
            raise PositionUnknown(f"request {rid!r}: a decode row without its position, which this runner never had")
        self.next_positions[index] = positions + 1
        self.decode_positions = positions
        return rows

    def _write(self, row: int, offset: int, blocks: list[int], request_id: str) -> None:
        old = self.lengths[row]
        if offset > old or (offset < old and offset):
            raise BlockTableGap(
                f"request {request_id!r}: a batch brings its blocks from {offset} on, this runner holds {old}"
            )
        end = offset + len(blocks)
        if end > self.max_blocks:
            raise BlockTableGap(f"request {request_id!r}: {end} blocks, more than a table row holds")
        table = self.block_tables[row]
        table[offset:end] = blocks
        if end < old:  # a table started again (a preempted request back): nothing of the old one may show
            table[end:old] = 0
        self.lengths[row] = end
        self.num_blocks[row] = end

    def _take(self, request_id: str) -> int:
        if not self.free_rows:
            self._grow()
        row = self.free_rows.pop()
        self.rows[request_id] = row
        return row

    def _drop(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        self.block_tables[row, : self.lengths[row]] = 0
        self.lengths[row] = 0
        self.num_blocks[row] = 0
        self.next_positions[row] = -1
        self.free_rows.append(row)

    def _grow(self) -> None:
        capacity = len(self.lengths)
        self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self.next_positions = np.concatenate([self.next_positions, np.full_like(self.next_positions, -1)])
        self.lengths += [0] * capacity
        self.free_rows += range(2 * capacity - 1, capacity - 1, -1)

    def gather(self, rows: list[int]) -> tuple[np.ndarray, int]:
        """The block tables of `rows` [len(rows), width], padded with 0, width the most blocks any of them has."""
        index = np.array(rows, dtype=np.intp)
        width = int(self.num_blocks[index].max()) if rows else 0
        return self.block_tables[index, :width], width
