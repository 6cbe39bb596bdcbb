"""The benches' CSV files: rows are appended run after run (a grid can be measured in slices,
one device call each), so a file may hold rows written by an older version of the bench."""

from __future__ import annotations

import contextlib
import csv
import os
from typing import NamedTuple


class Attention(NamedTuple):
    """The attention a features row measures (bench features and its head-dim cases): its dtype's name, head dim
    ("dqk/dv" where the value's differs) and query heads."""

    dtype: str
    headdim: int | str
    nheads: int


@contextlib.contextmanager
def appending(path: str, fields: list[str], fill=lambda row: {}):
    """Yields (writer, file) appending rows with columns `fields` to the CSV at path. A new or
    empty file gets the header. A file whose header lacks some of `fields` (written by an
    older bench) is first rewritten with the new header, each old row completed by fill(row)
    (columns fill leaves out stay empty); a header with columns this version does not know
    raises ValueError rather than dropping them."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    header = None
    if os.path.exists(path):
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames
            old_rows = list(reader) if header and list(header) != list(fields) else None
        if old_rows is not None:
            unknown = [c for c in header if c not in fields]
            if unknown:
                raise ValueError(
                    f"{path}: columns {unknown} are not written by this version of the bench "
                    f"(expected a subset of {fields})"
                )
            long_rows = [i + 2 for i, row in enumerate(old_rows) if None in row]
            if long_rows:
                raise ValueError(f"{path}: lines {long_rows[:5]} hold more fields than its header")
            tmp = path + ".tmp"
            try:
                with open(tmp, "w", newline="") as fh:
                    writer = csv.DictWriter(fh, fieldnames=fields, restval="")
                    writer.writeheader()
                    for row in old_rows:
                        writer.writerow({**row, **fill(row)})
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, restval="")
        if not header:
            writer.writeheader()
        yield writer, fh
