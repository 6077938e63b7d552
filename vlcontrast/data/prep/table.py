"""``vlcontrast prep csv FILE OUT --image-key filepath --caption-key title``: a table -> shards.

open_clip's CSV convention (``--csv-img-key``, ``--csv-caption-key``, ``--csv-separator``): a
header row names the columns; the image column holds local paths (absolute, or relative to the
table's folder) or http(s) URLs.

* Local paths: images are read and re-encoded (:func:`~.writer.encode_image`) by the shared
  writer. Rows naming the same image are merged: its captions go into the sample's ``.json`` as
  ``captions`` (COCO-style tables with five rows per image), ``.txt`` holds the first. A cell
  is one caption: its line breaks and runs of whitespace become one space.
* URLs: the rows are handed to img2dataset through ``prep cc3m``'s path (a URL list -> shards),
  with its resume and statistics.

The separator defaults to ``,`` for ``.csv`` and to a tab otherwise (open_clip's default);
``--sep`` overrides it. JSON lines (``.jsonl``/``.ndjson``, or any file whose first line is a JSON
object: one object per line, its keys are the columns) and ``.parquet`` files are read too. Rows
with an empty image or caption cell are skipped and counted. A missing column, a table mixing
URLs and paths, or an empty table is an error naming the file and the line before any image is
read.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Iterator

from vlcontrast.errors import DataPrepError

from .writer import (DEFAULT_IMAGE_SIZE, DEFAULT_QUALITY, MAX_EXAMPLES, MAX_IMAGE_PIXELS,
                     REPORT_FILE, ShardJob, Skip, check_image_options, check_val_fraction,
                     encode_image, fingerprint, one_line, prepare_layout, prepare_out,
                     resolve_inputs, split_items, split_path, write_shards)

DEFAULT_SHARD_SIZE = 1000
_URL = re.compile(r"^https?://", re.IGNORECASE)


_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_TABLE_SUFFIXES = (".csv", ".tsv", ".tab", ".parquet", *_JSONL_SUFFIXES)


def default_separator(path: Path) -> str:
    return "," if path.suffix.lower() == ".csv" else "\t"


def table_format(path: Path) -> str:
    """``"parquet"``, ``"jsonl"`` (by suffix, or a first line that is a JSON object) or
    ``"csv"`` (any separator)."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "parquet"
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 20).strip()
        if first.startswith(b"{") and isinstance(json.loads(first), dict):
            return "jsonl"
    except (OSError, ValueError):
        pass
    return "csv"


def _cell(value: Any) -> list[str]:
    """A JSON/parquet cell as text: a list gives one entry per element, None nothing."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _cell(v)]
    return [one_line(str(value))]


class _Skips:
    """Skipped rows by reason, with up to ``MAX_EXAMPLES`` ``table:line`` examples of each."""

    def __init__(self, path: Path):
        self.name = path.name
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}

    def __call__(self, reason: str, line: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.examples.setdefault(reason, [])) < MAX_EXAMPLES:
            self.examples[reason].append(f"{self.name}:{line}")


def read_table(path: Path, image_key: str, caption_key: str, sep: str
               ) -> tuple[list[tuple[int, str, str]], dict[str, int], dict[str, list[str]]]:
    """Rows ``(line, image, caption)`` with both cells filled; skipped rows by reason."""
    command = "prep csv"
    if path.is_dir():
        tables = sorted(p for p in path.iterdir() if p.suffix.lower() in _TABLE_SUFFIXES
                        and p.is_file())
        example = f", e.g. {str(tables[0])!r}" if tables else ""
        raise DataPrepError(f"{command}: {str(path)!r} is a folder; {command} takes a CSV/TSV "
                            f"file with a header row{example} (for a folder of images run "
                            f"`vlcontrast prep folder {shlex.quote(str(path))} OUT`)")
    if not path.is_file():
        raise DataPrepError(f"{command}: table {str(path)!r} does not exist")
    kind = table_format(path)
    skip = _Skips(path)
    rows = (_read_csv(path, image_key, caption_key, sep, skip) if kind == "csv" else
            _read_records(path, kind, image_key, caption_key, skip))
    if not rows:
        raise DataPrepError(f"{command}: {path} has no row with both an image and a caption "
                            f"(skipped {skip.counts})")
    return rows, skip.counts, skip.examples


def _read_csv(path: Path, image_key: str, caption_key: str, sep: str, skip: _Skips
              ) -> list[tuple[int, str, str]]:
    command = "prep csv"
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    rows: list[tuple[int, str, str]] = []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f, delimiter=sep)
            header = next(reader, None)
            if header is None:
                raise DataPrepError(f"{command}: {path} is empty (expected a header row naming "
                                    f"the {image_key!r} and {caption_key!r} columns)")
            header = [h.strip() for h in header]
            missing = [k for k in (image_key, caption_key) if k not in header]
            if missing:
                hint = _separator_hint(header, sep)
                raise DataPrepError(
                    f"{command}: {path}:1 has no column {missing[0]!r}; its columns are "
                    f"{header[:12]}{hint}: name them with --image-key and --caption-key")
            image_col, caption_col = header.index(image_key), header.index(caption_key)
            for line, cells in enumerate(reader, start=2):
                if not cells or all(not c.strip() for c in cells):
                    continue
                image = cells[image_col].strip() if image_col < len(cells) else ""
                caption = one_line(cells[caption_col]) if caption_col < len(cells) else ""
                if not image:
                    skip("missing_image", line)
                elif not caption:
                    skip("empty_caption", line)
                else:
                    rows.append((line, image, caption))
    except UnicodeDecodeError as err:
        raise DataPrepError(f"{command}: {path} is not UTF-8 text ({err})") from None
    except csv.Error as err:
        raise DataPrepError(f"{command}: {path}: {err}") from None
    return rows


def _read_records(path: Path, kind: str, image_key: str, caption_key: str, skip: _Skips
                  ) -> list[tuple[int, str, str]]:
    """:func:`read_table` for JSON lines (line numbers) and parquet (row numbers from 1). A cell
    holding a list of captions gives one row per caption (merged again per image)."""
    command = "prep csv"
    rows: list[tuple[int, str, str]] = []

    def missing(columns: list[str], where: str) -> DataPrepError:
        absent = next(k for k in (image_key, caption_key) if k not in columns)
        return DataPrepError(f"{command}: {where} has no {'key' if kind == 'jsonl' else 'column'} "
                             f"{absent!r}; its {'keys' if kind == 'jsonl' else 'columns'} are "
                             f"{columns[:12]}: name them with --image-key and --caption-key")

    def add(line: int, record: dict) -> None:
        images, captions = _cell(record.get(image_key)), _cell(record.get(caption_key))
        images = [i for i in images if i]
        captions = [c for c in captions if c]
        if not images:
            skip("missing_image", line)
        elif not captions:
            skip("empty_caption", line)
        else:
            rows.extend((line, images[0], caption) for caption in captions)

    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataPrepError(f"{command}: reading {path.name} needs pyarrow (pip install "
                                "pyarrow), or write the table as CSV/TSV/JSON lines") from None
        try:
            parquet = pq.ParquetFile(path)
        except Exception as err:  # noqa: BLE001 - any unreadable file is one line
            raise DataPrepError(f"{command}: {path} is not a readable parquet file ({err})") from None
        columns = list(parquet.schema_arrow.names)
        if image_key not in columns or caption_key not in columns:
            raise missing(columns, str(path))
        line = 0
        for batch in parquet.iter_batches(columns=[image_key, caption_key]):
            for record in batch.to_pylist():
                line += 1
                add(line, record)
    else:
        first_keys: list[str] | None = None
        try:
            with open(path, encoding="utf-8") as f:
                for line, text in enumerate(f, start=1):
                    if not text.strip():
                        continue
                    try:
                        record = json.loads(text)
                    except ValueError:
                        record = None
                    if not isinstance(record, dict):
                        if first_keys is None:
                            raise DataPrepError(f"{command}: {path}:{line} is not a JSON object "
                                                "(JSON lines: one {...} object per line)")
                        skip("invalid_json", line)
                        continue
                    if first_keys is None:
                        first_keys = list(record)
                        if image_key not in record or caption_key not in record:
                            raise missing(first_keys, f"{path}:{line}")
                    add(line, record)
        except UnicodeDecodeError as err:
            raise DataPrepError(f"{command}: {path} is not UTF-8 text ({err})") from None
    return rows


def _produce(job: ShardJob) -> Iterator[Any]:
    settings = job.settings
    for image, captions, line in job.items:
        where = f"{settings['name']}:{line}"
        try:
            data = Path(image).read_bytes()
        except OSError:
            yield Skip("missing_image_file", where)
            continue
        encoded = encode_image(data, image_size=settings["image_size"],
                               resize_mode=settings["resize_mode"], quality=settings["quality"],
                             max_pixels=settings["max_pixels"])
        if isinstance(encoded, str):
            yield Skip(encoded, where)
            continue
        meta: dict[str, Any] = {"source_path": image, "caption": captions[0], "line": line}
        if len(captions) > 1:
            meta["captions"] = captions
        yield {"jpg": encoded, "txt": captions[0], "json": meta}


def prepare_table(table: str | os.PathLike, out: str | os.PathLike, *, image_key: str = "filepath",
                  caption_key: str = "title", sep: str | None = None,
                  image_size: int = DEFAULT_IMAGE_SIZE, resize_mode: str = "keep_ratio",
                  encode_quality: int = DEFAULT_QUALITY, shard_size: int = DEFAULT_SHARD_SIZE,
                  max_image_pixels: int = MAX_IMAGE_PIXELS, val_fraction: float = 0.0,
                  workers: int | None = None, overwrite: bool = False, progress: bool = True,
                  url_options: dict[str, Any] | None = None,
                  split_root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Convert a CSV/TSV of images and captions into shards in ``out``; returns the report, or
    ``{"train": report, "val": report}`` with ``val_fraction`` (local paths only: each image is
    held out by the hash of its path as the table spells it, or, with ``split_root``, of its
    path under that folder: ``prep folder``'s rule with DIR as ``split_root``,
    :func:`~.writer.split_path`). Each caption cell is one caption, its line
    breaks and runs of whitespace made one space (:func:`~.writer.one_line`)."""
    command = "prep csv"
    path = Path(table)
    check_val_fraction(val_fraction, command)
    sep = default_separator(path) if sep is None else sep.encode().decode("unicode_escape")
    if len(sep) != 1:
        raise DataPrepError(f"{command}: --sep={sep!r}: must be one character (',' or '\\t')")
    check_image_options(image_size, resize_mode, encode_quality, max_image_pixels)
    if not 1 <= shard_size <= 1_000_000:
        raise DataPrepError(f"{command}: --shard-size={shard_size}: must be in 1..1000000")
    rows, skipped, examples = read_table(path, image_key, caption_key, sep)
    urls = [bool(_URL.match(image)) for _, image, _ in rows]
    if any(urls):
        if not all(urls):
            line = rows[urls.index(False) if urls[0] else urls.index(True)][0]
            raise DataPrepError(f"{command}: {path}:{line}: the {image_key!r} column mixes URLs "
                                "and local paths; split the table into one of each")
        if val_fraction:
            raise DataPrepError(f"{command}: --val-fraction works on local paths; for URLs, "
                                "download first (without it), then split the shards' list")
        if not overwrite:  # --overwrite: prep cc3m removes the earlier files after its checks
            prepare_layout(out, split=False, overwrite=False, command=command)
        return _prepare_urls(path, out, rows, skipped, image_size=image_size,
                             resize_mode=resize_mode, encode_quality=encode_quality,
                             overwrite=overwrite, examples=examples, image_key=image_key,
                             caption_key=caption_key, **(url_options or {}))

    base = path.resolve().parent
    merged: dict[str, tuple[list[str], int]] = {}
    for line, image, caption in rows:
        full = image if os.path.isabs(image) else str(base / image)
        captions, _ = merged.setdefault(full, ([], line))
        if caption not in captions:
            captions.append(caption)
    items = [(image, captions, line) for image, (captions, line) in merged.items()]
    settings = {"name": path.name, "image_size": image_size, "resize_mode": resize_mode,
                "quality": encode_quality, "max_pixels": max_image_pixels}
    common = dict(image_key=image_key, caption_key=caption_key, sep=sep,
                  encode_quality=encode_quality, shard_size=shard_size, workers=workers,
                  overwrite=overwrite, progress=progress, command=command)
    # the path as the table spells it, or under split_root (prep folder's rule with DIR there)
    spelled = {line: image for line, image, _ in rows}
    parts = split_items(items, (lambda item: spelled[item[2]]) if split_root is None else
                        (lambda item: split_path(item[0], split_root)), val_fraction, command) \
        if val_fraction > 0 else None
    # Every input check has passed: only now may --overwrite remove an earlier prep's files
    # (never an input of this one: the table and its images).
    inputs = resolve_inputs([path, *merged]) if overwrite else frozenset()
    prepare_layout(out, split=val_fraction > 0, overwrite=overwrite, command=command,
                   inputs=inputs)
    common["inputs"] = inputs
    if parts is not None:
        # The rows the reader skipped are reported once, with the training split.
        return {name: _write_table_shards(path, Path(out) / name, part, rows, settings,
                                          skipped if name == "train" else {},
                                          examples if name == "train" else {}, **common)
                for name, part in parts.items()}
    return _write_table_shards(path, Path(out), items, rows, settings, skipped, examples,
                               **common)


def _write_table_shards(path: Path, out: Path, items: list, rows: list, settings: dict[str, Any],
                        skipped: dict[str, int], examples: dict, *, image_key: str,
                        caption_key: str, sep: str, encode_quality: int, shard_size: int,
                        workers: int | None, overwrite: bool, progress: bool,
                        command: str, inputs: frozenset[str] = frozenset()) -> dict[str, Any]:
    image_size, resize_mode = settings["image_size"], settings["resize_mode"]
    jobs = [ShardJob(n, items[start:start + shard_size], settings)
            for n, start in enumerate(range(0, len(items), shard_size))]
    digest = fingerprint("csv", settings, items, shard_size)
    out_path = prepare_out(out, digest, overwrite=overwrite, command=command, inputs=inputs)
    return write_shards(out_path, jobs, _produce, digest=digest, source="csv", workers=workers,
                        progress=progress, inputs=len(items) + sum(skipped.values()),
                        skipped_before=skipped, examples_before=examples,
                        table=str(path.resolve()), table_rows=len(rows) + sum(skipped.values()),
                        settings={"image_key": image_key, "caption_key": caption_key, "sep": sep,
                                  "image_size": image_size, "resize_mode": resize_mode,
                                  "encode_quality": encode_quality, "shard_size": shard_size})


def _prepare_urls(path: Path, out: str | os.PathLike, rows: list[tuple[int, str, str]],
                  skipped: dict[str, int], *, image_size: int, resize_mode: str,
                  encode_quality: int, overwrite: bool, examples: dict[str, list[str]] | None = None,
                  image_key: str = "filepath", caption_key: str = "title",
                  **options: Any) -> dict[str, Any]:
    """URL rows -> a header-less ``caption<TAB>url`` list -> ``prep cc3m``'s img2dataset path.

    The manifest says ``source: "csv"`` (``downloader: "img2dataset"``) and names the table;
    ``skipped`` counts the table's skipped rows and the failed downloads by reason, and
    ``OUT/prep_report.json`` is written as by the other converters."""
    from vlcontrast.data.shards import write_manifest

    from .cc3m import prepare_cc3m

    out_path = Path(out)
    listing = out_path / "_input" / (path.stem + ".urls.tsv")
    listing.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{' '.join(caption.split())}\t{url}\n" for _, url, caption in rows)
    if not listing.is_file() or listing.read_text(encoding="utf-8") != text:
        listing.write_text(text, encoding="utf-8")  # unchanged: keep its mtime (resume)
    if resize_mode not in ("keep_ratio", "keep_ratio_largest", "center_crop", "no"):
        raise DataPrepError(f"prep csv: --resize-mode={resize_mode!r} is not an img2dataset mode")
    table_rows = len(rows) + sum(skipped.values())
    report = prepare_cc3m(listing, out_path, image_size=image_size, resize_mode=resize_mode,
                          encode_quality=encode_quality, incremental=not overwrite,
                          command="prep csv", inputs=[path],
                          manifest_extra={"source": "csv", "downloader": "img2dataset",
                                          "table": str(path.resolve()), "table_rows": table_rows,
                                          "image_key": image_key, "caption_key": caption_key},
                          **options)
    failed = {reason: int(report.get(reason, 0))
              for reason in ("failed_to_download", "failed_to_resize") if report.get(reason)}
    all_skipped = dict(sorted({**skipped, **failed}.items()))
    keys = ("out_dir", "shards_done_before", "shards_written", "seconds")
    manifest = {k: v for k, v in report.items() if k not in keys}
    manifest.update(inputs=table_rows, skipped=all_skipped, table_skipped=skipped)
    write_manifest(out_path, manifest)
    seconds = report["seconds"]
    full = {**manifest, "examples": dict(examples or {}),
            **{k: report[k] for k in keys},
            "samples_per_second": round(report["num_samples"] / seconds, 1) if seconds else 0.0}
    tmp = out_path / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(full, indent=2) + "\n")
    os.replace(tmp, out_path / REPORT_FILE)
    return full


def _separator_hint(header: list[str], sep: str) -> str:
    """For a header read as one column: the separator it seems to use, as the ``--sep`` to give."""
    if len(header) != 1:
        return ""
    counts = {c: header[0].count(c) for c in (",", "\t", ";", "|") if c != sep}
    found = max(counts, key=counts.get) if any(counts.values()) else None
    if found is None:
        return " (the separator may be wrong: try --sep ',' or --sep '\\t')"
    shown = "'\\t'" if found == "\t" else repr(found)
    return f" (the header seems to be separated by {shown}: give --sep {shown})"
