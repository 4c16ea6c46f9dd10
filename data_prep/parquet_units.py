"""Parquet files cut into byte ranges of whole row groups, so that several builders share a large file.

A range ``[start, stop)`` of a parquet file holds the row groups whose data begins in it (a row group begins where
its first column chunk does: its dictionary page, else its first data page). Cuts fall at row group starts about
``unit_bytes`` apart, so every row is read once, in file order, however the file is cut.
"""
from __future__ import annotations

import bisect
from pathlib import Path


def row_group_starts(path: Path) -> list[int]:
    """The byte offset where each row group's data begins, in file order."""
    import pyarrow.parquet as pq  # optional: only parquet inputs need it

    metadata = pq.ParquetFile(path).metadata
    starts = []
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        chunks = [group.column(c) for c in range(group.num_columns)]
        starts.append(min(c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks))
    return starts


def parquet_units(path: Path, unit_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``unit_bytes``, cut at row group starts; ``[(0, -1)]`` (the whole file) when it is no
    larger or has one row group."""
    size = path.stat().st_size
    if size <= unit_bytes:
        return [(0, -1)]
    starts = row_group_starts(path)
    cuts = [0]
    for target in range(unit_bytes, size, unit_bytes):
        at = bisect.bisect_left(starts, target)
        if at < len(starts) and starts[at] > cuts[-1]:
            cuts.append(starts[at])
    if len(cuts) == 1:
        return [(0, -1)]
    cuts = [*dict.fromkeys(cuts), size]
    return list(zip(cuts, cuts[1:]))


def row_groups_in(path: Path, start: int, stop: int) -> tuple[list[int], int]:
    """The row groups that begin in bytes ``[start, stop)`` (stop -1: to the end), and how many rows come before
    the first of them (so a skipped row is named by its row number in the file)."""
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    starts = row_group_starts(path)
    groups = [i for i, at in enumerate(starts) if at >= start and (stop == -1 or at < stop)]
    rows_before = sum(metadata.row_group(i).num_rows for i in range(groups[0])) if groups else 0
    return groups, rows_before
