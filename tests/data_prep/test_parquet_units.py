"""Parquet files cut into ranges of whole row groups: every row once, in order, however the file is cut."""
from __future__ import annotations

import pytest

from data_prep.parquet_units import parquet_units, row_group_starts, row_groups_in

pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture
def table_file(samples_dir, tmp_path):
    import pyarrow as pa

    news = (samples_dir / "news/lee.txt").read_text(encoding="utf-8").split("\n\n")
    path = tmp_path / "news.parquet"
    pq.write_table(pa.table({"id": list(range(len(news))), "text": news}), path, row_group_size=25)
    return path, news


def test_row_groups_of_every_range_are_the_file_once_in_order(table_file):
    path, news = table_file
    starts = row_group_starts(path)
    assert len(starts) == 12 and starts == sorted(starts)
    assert parquet_units(path, 10**9) == [(0, -1)]
    units = parquet_units(path, path.stat().st_size // 5)
    assert 4 <= len(units) <= 6 and units[0][0] == 0 and units[-1][1] == path.stat().st_size
    assert all(start in starts for start, _ in units[1:])
    groups, rows_before = zip(*(row_groups_in(path, start, stop) for start, stop in units))
    assert [g for unit in groups for g in unit] == list(range(12))
    assert list(rows_before) == [25 * unit[0] for unit in groups]
    parquet = pq.ParquetFile(path)
    rows = [t for unit in groups for batch in parquet.iter_batches(columns=["text"], row_groups=unit)
            for t in batch.column(0).to_pylist()]
    assert rows == news
