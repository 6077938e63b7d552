"""CC3M preparation: Google's TSV -> webdataset shards, by driving img2dataset.

Google ships Conceptual Captions as header-less ``caption<TAB>url`` files
(``Train_GCC-training.tsv``: 3,318,333 rows; ``Validation_GCC-1.1.0-Validation.tsv``: 15,840 rows).
:func:`prepare_cc3m` checks the file's first lines, converts it once to ``OUT/_input/cc3m.parquet``
(named columns, no CSV quoting surprises: CC3M captions contain quote characters), then calls
``img2dataset.download`` which downloads, resizes and writes ``OUT/00000.tar`` ... plus one
``00000_stats.json`` per finished shard. From those stats it writes ``sizes.json`` and
``manifest.json`` (see :mod:`vlcontrast.data.shards`).

Re-running the same command resumes: img2dataset's incremental mode skips every shard that already
has its ``_stats.json``, and the parquet conversion is reused while the TSV is unchanged.
Settings and numbers: ``docs/data.md``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from vlcontrast.errors import DataPrepError

from ..naming import key_stride, shard_name
from ..shards import MANIFEST_FILE, SIZES_FILE, build_manifest, write_manifest, write_sizes

CC3M_SETTINGS: dict[str, Any] = {
    "image_size": 256,
    "resize_mode": "keep_ratio",
    "encode_quality": 95,
    "encode_format": "jpg",
    "number_sample_per_shard": 10_000,
    "timeout": 10,
    "retries": 2,
    "user_agent_token": "img2dataset",
    "disallowed_header_directives": None,
}
"""Defaults of :func:`prepare_cc3m`. 256 px on the short side (keep_ratio) leaves the crop to the
training transform; img2dataset's own CC3M example uses the same size with ``border``.
``disallowed_header_directives=None`` keeps img2dataset's default (honour ``X-Robots-Tag: noai,
noimageai, noindex, noimageindex``)."""

RESIZE_MODES = ("no", "border", "keep_ratio", "keep_ratio_largest", "center_crop")
_STATS_FILE = re.compile(r"^(\d+)_stats\.json$")
_URL = re.compile(r"^https?://", re.IGNORECASE)
_CHECK_LINES = 100


def check_tsv(tsv: str | os.PathLike, lines: int = _CHECK_LINES) -> dict[str, Any]:
    """Check the first ``lines`` rows of a CC3M-style TSV before any heavy work.

    Returns ``{"header": bool, "url_column": 0 | 1}``: a ``caption<TAB>url`` header line is
    accepted (img2dataset's docs tell users to add one) and ``url<TAB>caption`` files (CC12M) are
    recognised. Raises ``FileNotFoundError`` or :class:`DataPrepError` naming the file and line.
    """
    path = Path(tsv)
    if not path.is_file():
        raise FileNotFoundError(f"CC3M TSV {str(path)!r} does not exist; give the caption/URL "
                                "TSV of the Conceptual Captions download "
                                "(Train_GCC-training.tsv, Validation_GCC-1.1.0-Validation.tsv)")
    header = False
    url_columns: set[int] = set()
    seen = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if seen >= lines:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataPrepError(f"{path}:{line_number}: not UTF-8 text ({err})") from None
            fields = line.rstrip("\r\n").split("\t")
            if line_number == 1 and [x.strip().lower() for x in fields] in (["caption", "url"],
                                                                            ["url", "caption"]):
                header = True
                url_columns.add([x.strip().lower() for x in fields].index("url"))
                continue
            if len(fields) != 2:
                raise DataPrepError(
                    f"{path}:{line_number}: expected 2 tab-separated columns (caption<TAB>url), "
                    f"found {len(fields)}: {line[:120]!r}")
            urls = [i for i, x in enumerate(fields) if _URL.match(x.strip())]
            if len(urls) != 1:
                raise DataPrepError(
                    f"{path}:{line_number}: expected one http(s) URL column and one caption "
                    f"column, got {line[:120]!r}")
            url_columns.add(urls[0])
            seen += 1
    if seen == 0:
        raise DataPrepError(f"{path}: no rows (expected caption<TAB>url lines)")
    if len(url_columns) != 1:
        raise DataPrepError(f"{path}: the URL is in column 1 on some lines and column 2 on others")
    return {"header": header, "url_column": url_columns.pop()}


def _convert_to_parquet(tsv: Path, layout: dict[str, Any], input_dir: Path) -> dict[str, Any]:
    """TSV -> ``input_dir/cc3m.parquet`` with columns ``caption``, ``url``; reused when unchanged."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    stat = tsv.stat()
    source = {"tsv": str(tsv.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    parquet = input_dir / "cc3m.parquet"
    source_file = input_dir / "source.json"
    if parquet.is_file() and source_file.is_file():
        previous = json.loads(source_file.read_text())
        if {k: previous.get(k) for k in source} == source:
            return previous
    input_dir.mkdir(parents=True, exist_ok=True)
    skipped: list[str] = []

    def skip(row) -> str:
        if len(skipped) < 20:
            skipped.append(f"row {row.number}: {row.text[:120]!r}")
        else:
            skipped.append("")
        return "skip"

    names = ["url", "caption"] if layout["url_column"] == 0 else ["caption", "url"]
    table = pa_csv.read_csv(
        tsv,
        read_options=pa_csv.ReadOptions(column_names=names, skip_rows=1 if layout["header"] else 0,
                                         block_size=1 << 24),
        # No quoting: a CC3M caption may contain '"' and must arrive verbatim.
        parse_options=pa_csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False,
                                          escape_char=False, invalid_row_handler=skip),
        convert_options=pa_csv.ConvertOptions(column_types={"caption": pa.string(), "url": pa.string()},
                                              strings_can_be_null=False),
    )
    table = table.select(["caption", "url"])
    tmp = parquet.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, parquet)
    info = {**source, "rows": table.num_rows, "skipped_rows": len(skipped),
            "skipped_examples": [s for s in skipped if s]}
    source_file.write_text(json.dumps(info, indent=2))
    return info


def _set_aside_json(out: Path) -> list[tuple[Path, Path]]:
    """Move non-stats ``*.json`` files out of img2dataset's way.

    img2dataset's incremental mode takes ``int(name.split("_")[0])`` of *every* ``OUT/*.json`` to
    find finished shards, so ``sizes.json`` or a check report there makes a re-run crash.
    ``sizes.json``/``manifest.json`` are rewritten afterwards; other files are put back.
    """
    moved: list[tuple[Path, Path]] = []
    aside = out / "_aside"
    for path in sorted(out.glob("*.json")):
        if _STATS_FILE.match(path.name):
            continue
        if path.name in (SIZES_FILE, MANIFEST_FILE):
            path.unlink()
            continue
        aside.mkdir(exist_ok=True)
        target = aside / path.name
        os.replace(path, target)
        moved.append((target, path))
    return moved


def _finished_shards(out: Path) -> dict[int, dict[str, Any]]:
    stats = {}
    for path in out.glob("*_stats.json"):
        match = _STATS_FILE.match(path.name)
        if match:
            with open(path) as f:
                stats[int(match.group(1))] = json.load(f)
    return stats


def _remove_shards(out: Path) -> None:
    for path in out.iterdir():
        stem = path.name.split(".")[0].split("_")[0]
        if stem.isdigit() and (path.suffix in (".tar", ".parquet") or _STATS_FILE.match(path.name)):
            path.unlink()


def prepare_cc3m(tsv: str | os.PathLike, out_dir: str | os.PathLike, *,
                 processes: int | None = None, threads: int = 64,
                 image_size: int = CC3M_SETTINGS["image_size"],
                 resize_mode: str = CC3M_SETTINGS["resize_mode"],
                 number_sample_per_shard: int = CC3M_SETTINGS["number_sample_per_shard"],
                 timeout: int = CC3M_SETTINGS["timeout"], retries: int = CC3M_SETTINGS["retries"],
                 encode_quality: int = CC3M_SETTINGS["encode_quality"],
                 user_agent_token: str | None = CC3M_SETTINGS["user_agent_token"],
                 disallowed_header_directives: list[str] | None = None,
                 incremental: bool = True) -> dict[str, Any]:
    """Download a CC3M TSV into webdataset shards in ``out_dir``; returns the manifest plus run info.

    ``processes``/``threads``: img2dataset download processes and threads per process.
    ``incremental=False`` deletes earlier shards of ``out_dir`` first (the parquet is kept).
    The returned dict is ``manifest.json`` plus ``shards_done_before`` (finished shards found at
    start), ``shards_written`` (finished in this call), ``incomplete_shards`` and ``seconds``.
    """
    processes = processes or os.cpu_count() or 1
    if resize_mode not in RESIZE_MODES:
        raise DataPrepError(f"resize_mode={resize_mode!r}: must be one of {RESIZE_MODES}")
    for name, value in (("processes", processes), ("threads", threads), ("image_size", image_size),
                        ("number_sample_per_shard", number_sample_per_shard), ("timeout", timeout)):
        if value < 1:
            raise DataPrepError(f"{name}={value}: must be >= 1")
    if retries < 0:
        raise DataPrepError(f"retries={retries}: must be >= 0")
    tsv = Path(tsv)
    layout = check_tsv(tsv)  # before anything is created or downloaded

    # img2dataset imports albumentations, which otherwise asks PyPI for a newer version on import.
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import img2dataset

    start = time.perf_counter()
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    source = _convert_to_parquet(tsv, layout, out / "_input")
    if not incremental:
        _remove_shards(out)
    done_before = set(_finished_shards(out))
    moved = _set_aside_json(out)
    previous_sigint = signal.getsignal(signal.SIGINT)
    try:
        img2dataset.download(
            url_list=str(out / "_input" / "cc3m.parquet"),
            input_format="parquet",
            url_col="url",
            caption_col="caption",
            output_format="webdataset",
            output_folder=str(out),
            processes_count=processes,
            thread_count=threads,
            image_size=image_size,
            resize_mode=resize_mode,
            encode_quality=encode_quality,
            encode_format=CC3M_SETTINGS["encode_format"],
            number_sample_per_shard=number_sample_per_shard,
            timeout=timeout,
            retries=retries,
            user_agent_token=user_agent_token,
            disallowed_header_directives=disallowed_header_directives,
            enable_wandb=False,
            distributor="multiprocessing",
            incremental_mode="incremental",
            oom_shard_count=5,
        )
    finally:
        # img2dataset installs a SIGINT handler that exits with status 0; put ours back.
        try:
            signal.signal(signal.SIGINT, previous_sigint)
        except ValueError:  # not the main thread
            pass
        for target, original in moved:
            os.replace(target, original)
        if (out / "_aside").is_dir() and not any((out / "_aside").iterdir()):
            (out / "_aside").rmdir()

    finished = _finished_shards(out)
    expected = -(-source["rows"] // number_sample_per_shard)
    incomplete = [shard_name(i) for i in range(expected) if i not in finished]
    sizes = {shard_name(i): int(stats["successes"]) for i, stats in finished.items()}
    totals = {k: sum(int(s.get(k, 0)) for s in finished.values())
              for k in ("count", "successes", "failed_to_download", "failed_to_resize")}
    errors: dict[str, int] = {}
    for stats in finished.values():
        for message, n in (stats.get("status_dict") or {}).items():
            if message != "success":
                errors[message] = errors.get(message, 0) + int(n)
    manifest = build_manifest(
        sizes, stride=key_stride(number_sample_per_shard), source="img2dataset",
        tsv=str(tsv.resolve()), tsv_rows=source["rows"], tsv_skipped_rows=source["skipped_rows"],
        attempted=totals["count"], failed_to_download=totals["failed_to_download"],
        failed_to_resize=totals["failed_to_resize"],
        success_rate=round(totals["successes"] / totals["count"], 4) if totals["count"] else 0.0,
        top_errors=dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
        incomplete_shards=incomplete,
        settings={"image_size": image_size, "resize_mode": resize_mode,
                  "encode_quality": encode_quality, "number_sample_per_shard": number_sample_per_shard,
                  "timeout": timeout, "retries": retries, "user_agent_token": user_agent_token,
                  "img2dataset": getattr(img2dataset, "__version__", _img2dataset_version())},
    )
    if sizes:
        write_sizes(out, sizes)
    write_manifest(out, manifest)
    shutil.rmtree(out / "_tmp", ignore_errors=True)
    return {**manifest, "out_dir": str(out), "shards_done_before": len(done_before),
            "shards_written": len(set(finished) - done_before),
            "seconds": round(time.perf_counter() - start, 2)}


def _img2dataset_version() -> str:
    try:
        from importlib.metadata import version

        return version("img2dataset")
    except Exception:  # noqa: BLE001 - a version string is informative only
        return "unknown"
