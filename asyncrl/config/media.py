"""veRL's picture and video columns in a data file (``data.image_key``, ``data.video_key``):
prompts here are text, so a file that holds pictures or videos in any row is refused at
launch rather than trained on its text alone, without a word. Read as arrow arrays: the
bytes never become Python objects."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa
    from pyarrow.parquet import ParquetFile

ROWS_PER_BATCH = 4096  # rows read at a time over a whole file


def media_problem(
    file: ParquetFile, f: str, media: tuple[str, ...], every_row: bool = True
) -> str | None:
    """The refusal of a file whose ``media`` columns (veRL's ``data.image_key`` and
    ``data.video_key``) hold a picture or a video in any row (with ``every_row`` off, in
    the first): prompts here are text, and would train without them, without a word. The
    columns are read as arrow arrays: their bytes never become Python objects."""
    columns = [c for c in dict.fromkeys(media) if c in file.schema_arrow.names]
    if not columns:
        return None
    number = 0
    size = ROWS_PER_BATCH if every_row else 1
    for batch in file.iter_batches(batch_size=size, columns=columns):
        if (first := _first_media(batch, columns)) is not None:
            column, row = first
            what, key = ("images", "image_key") if column == media[0] else ("videos", "video_key")
            return (
                f"data files: {f} holds {what} (column {column!r}, data.{key}; first in row "
                f"{number + row}): prompts here are text only and would train without them; "
                "use a text dataset, or drop the column to train on the text alone"
            )
        number += batch.num_rows
        if not every_row:
            break
    return None


def _first_media(batch: pa.RecordBatch, columns: list[str]) -> tuple[str, int] | None:
    """The first ``(column, row of batch)`` among ``columns`` that holds a picture or a
    video, or None."""
    import pyarrow.compute as pc

    first: tuple[str, int] | None = None
    for name in columns:
        if (full := _filled(batch.column(name))) is None:
            continue
        rows = pc.call_function("indices_nonzero", [pc.fill_null(full, False)])
        if len(rows) and (first is None or rows[0].as_py() < first[1]):
            first = (name, rows[0].as_py())
    return first


def _filled(array: pa.Array) -> pa.Array | None:
    """Per row, whether a media column holds something: a non-empty list (veRL's
    ``[{'bytes': ..., 'path': ...}]``), text or bytes (a path, an image), or any other value
    that is not null; None for a type that holds nothing (a column of nulls only)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_null(kind) or (pa.types.is_fixed_size_list(kind) and not kind.list_size):
        return None
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _positive(pc.call_function("list_value_length", [array]))
    text = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary)
    if any(is_kind(kind) for is_kind in (*text, pa.types.is_large_binary)):
        return _positive(pc.call_function("binary_length", [array]))
    return pc.call_function("is_valid", [array])


def _positive(lengths: pa.Array) -> pa.Array:
    """Per row, whether ``lengths`` is above 0 (pyarrow's compute functions are made at
    import, so they are called by name: the type checker knows no attribute of theirs)."""
    import pyarrow.compute as pc

    return pc.call_function("greater", [lengths, 0])
