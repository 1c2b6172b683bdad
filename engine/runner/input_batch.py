"""The runner's persistent batch: each live request keeps a row, and its block table in it, from step to step.

A batch carries only what changed since the batches before it (`ScheduledRequest.block_offset`: the blocks from
there on; `Batch.dropped`: the requests whose rows may go), so a decode step's block tables are a gather of rows
already in place, not a copy of every request's table.
"""

from __future__ import annotations

import numpy as np

from engine.core.scheduler import Batch


class BlockTableGap(RuntimeError):
    """A batch's blocks start past the end of what this runner holds of the request: a batch before it never got here."""


class InputBatch:
    """Rows of block tables by request, kept between steps. Every row past a request's blocks holds zeros, so a gather
    of rows is exactly the padded table a fresh build from whole tables gives."""

    def __init__(self, max_blocks: int, capacity: int = 8):
        self.max_blocks = max_blocks
        self.block_tables = np.zeros((capacity, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(capacity, dtype=np.int32)  # per row, for the batch's width in one gather
        self.lengths = [0] * capacity  # the same, read per request per step without a numpy scalar
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(capacity - 1, -1, -1))
        # The batch applied last and its rows: prepare may see one batch twice (a test, a re-run), and a diff applies
        # once.
        self._last: tuple[Batch, list[int]] | None = None

    def apply(self, batch: Batch) -> list[int]:
        """Drop the rows `batch` releases, write the blocks it brings; returns each of its requests' row."""
        last = self._last
        if last is not None and last[0] is batch:
            return last[1]
        for request_id in batch.dropped:
            self._drop(request_id)
        rows, lengths, get = [], self.lengths, self.rows.get
        # Per request per step: most decode steps bring no block, and cost a lookup and a comparison.
        for sr in batch.requests:
            row = get(sr.request_id)
            if row is None:
                row = self._take(sr.request_id)
            blocks, offset = sr.block_table, sr.block_offset
            if blocks or offset != lengths[row]:
                self._write(row, offset, blocks, sr.request_id)
            rows.append(row)
        self._last = batch, rows
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
        self.free_rows.append(row)

    def _grow(self) -> None:
        capacity = len(self.lengths)
        self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self.lengths += [0] * capacity
        self.free_rows += range(2 * capacity - 1, capacity - 1, -1)

    def gather(self, rows: list[int]) -> tuple[np.ndarray, int]:
        """The block tables of `rows` [len(rows), width], padded with 0, width the most blocks any of them has."""
        index = np.array(rows, dtype=np.intp)
        width = int(self.num_blocks[index].max()) if rows else 0
        return self.block_tables[index, :width], width
