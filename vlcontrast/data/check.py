"""Shard check: read every sample of every shard and report what a training run would trip on.

:func:`check_shards` counts samples per shard and finds images that fail to decode (PIL open +
load), samples without an image, missing or empty captions, unparsable ``.json`` members,
non-numeric keys, keys outside the manifest's id space, duplicate keys (within and across
shards), shards listed in ``sizes.json`` but absent, counts that disagree with ``sizes.json``, and
unreadable shards (truncated or corrupt tar). The report is JSON (``DIR/check_report.json`` by
default); ``vlcontrast prep check`` exits 1 when ``unreadable_shards`` is not empty.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .shards import expand_pattern, list_shards, read_manifest, read_sizes

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
CAPTION_EXTENSION = "txt"
MAX_EXAMPLES = 10
REPORT_FILE = "check_report.json"
PROBLEMS = ("undecodable_images", "missing_images", "missing_captions", "empty_captions",
            "invalid_json", "non_numeric_keys", "duplicate_keys")


def _split_name(name: str) -> tuple[str, str]:
    """webdataset's grouping rule: the key is the path up to the first dot of the basename."""
    directory, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, extension.lower() if dot else ""


def _check_sample(key: str, members: dict[str, bytes], result: dict[str, Any],
                  decode_images: bool) -> None:
    def problem(kind: str) -> None:
        result[kind] += 1
        if len(result["examples"][kind]) < MAX_EXAMPLES:
            result["examples"][kind].append(key)

    image_ext = next((ext for ext in IMAGE_EXTENSIONS if ext in members), None)
    if image_ext is None:
        problem("missing_images")
    elif decode_images:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(members[image_ext])) as image:
                image.load()
        except Exception:  # noqa: BLE001 - any decoder failure means the sample is unusable
            problem("undecodable_images")
    if CAPTION_EXTENSION not in members:
        problem("missing_captions")
    elif not members[CAPTION_EXTENSION].decode("utf-8", errors="replace").strip():
        problem("empty_captions")
    if "json" in members:
        try:
            json.loads(members["json"])
        except ValueError:
            problem("invalid_json")
    if not key.isdigit():
        problem("non_numeric_keys")
    else:
        result["ids"].append(int(key))


def check_shard(path: str, decode_images: bool = True) -> dict[str, Any]:
    """Read one shard; never raises: a broken tar is reported in ``error``."""
    result: dict[str, Any] = {"shard": os.path.basename(path), "path": path, "samples": 0,
                              "error": None, **{kind: 0 for kind in PROBLEMS},
                              "examples": {kind: [] for kind in PROBLEMS}, "ids": []}
    keys_seen: set[str] = set()

    def finish(key: str, members: dict[str, bytes], repeated: bool) -> None:
        result["samples"] += 1
        if key in keys_seen or repeated:
            result["duplicate_keys"] += 1
            if len(result["examples"]["duplicate_keys"]) < MAX_EXAMPLES:
                result["examples"]["duplicate_keys"].append(key)
        keys_seen.add(key)
        _check_sample(key, members, result, decode_images)

    if not os.path.exists(path):
        result["error"] = "missing: the shard file does not exist"
        return result
    key, members, repeated = None, {}, False
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                member_key, extension = _split_name(member.name)
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                if member_key != key:
                    if key is not None:
                        finish(key, members, repeated)
                    key, members, repeated = member_key, {}, False
                if extension in members:
                    repeated = True  # the same key written twice in a row
                members[extension] = data
            end_offset = tar.offset
        # tarfile ends quietly when a file stops at or inside a header; a complete archive has
        # a zero block where the iteration stopped.
        if path.endswith(".tar"):
            with open(path, "rb") as f:
                f.seek(end_offset)
                marker = f.read(tarfile.BLOCKSIZE)
            if len(marker) < tarfile.BLOCKSIZE or marker.count(0) != tarfile.BLOCKSIZE:
                result["error"] = (f"truncated: no end-of-archive marker at byte {end_offset} "
                                   f"(file has {os.path.getsize(path)} bytes)")
        # The last sample of a truncated shard may be missing members: not counted.
        if key is not None and result["error"] is None:
            finish(key, members, repeated)
    except (tarfile.TarError, OSError, EOFError) as err:
        result["error"] = f"unreadable after {result['samples']} samples: {type(err).__name__}: {err}"
    return result


def _check_job(job: tuple[str, bool]) -> dict[str, Any]:
    return check_shard(*job)


def _resolve(dir_or_pattern: str | os.PathLike) -> tuple[list[str], Path | None]:
    text = str(dir_or_pattern)
    if os.path.isdir(text):
        directory = Path(text)
        found = list_shards(directory)
        listed = [str(directory / name) for name in read_sizes(directory)]
        return sorted(set(found) | set(listed)), directory
    paths = expand_pattern(text)
    return paths, Path(os.path.dirname(paths[0]) or ".") if paths else None


def check_shards(dir_or_pattern: str | os.PathLike, report_path: str | os.PathLike | None = None,
                 progress: bool = True, *, workers: int = 1,
                 decode_images: bool = True) -> dict[str, Any]:
    """Check every shard of a directory (or brace pattern); write and return the JSON report.

    ``report_path`` defaults to ``DIR/check_report.json``. ``workers`` > 1 reads shards in
    parallel processes. ``progress`` shows a bar and prints a summary to stderr. The report's
    ``ok`` is false when any shard is unreadable or any sample has a problem; the CLI's exit
    status follows ``unreadable_shards`` only (bad samples are skipped by the loader).
    """
    start = time.perf_counter()
    paths, directory = _resolve(dir_or_pattern)
    if not paths:
        raise FileNotFoundError(f"no shards found at {str(dir_or_pattern)!r}")
    sizes = read_sizes(directory) if directory is not None else {}
    try:
        manifest = read_manifest(directory) if directory is not None else {}
    except FileNotFoundError:
        manifest = {}

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(paths), unit="shard", desc=f"check {dir_or_pattern}")
    jobs = [(path, decode_images) for path in paths]
    results: list[dict[str, Any]] = []
    pool = None
    if workers > 1 and len(jobs) > 1:
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        pool = multiprocessing.get_context(method).Pool(min(workers, len(jobs)))
        iterator = pool.imap_unordered(_check_job, jobs)
    else:
        iterator = map(_check_job, jobs)
    try:
        for result in iterator:
            results.append(result)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(samples=sum(r["samples"] for r in results))
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    results.sort(key=lambda r: r["path"])

    report: dict[str, Any] = {"path": str(dir_or_pattern), "num_shards": len(results),
                              "num_samples": sum(r["samples"] for r in results)}
    for kind in PROBLEMS:
        report[kind] = sum(r[kind] for r in results)
    examples = {kind: [] for kind in PROBLEMS}
    for r in results:
        for kind in PROBLEMS:
            examples[kind].extend(r["examples"][kind][:MAX_EXAMPLES - len(examples[kind])])

    # Duplicates across shards: the same id in two shards.
    all_ids = np.concatenate([np.asarray(r["ids"], np.int64) for r in results]) if results else np.zeros(0, np.int64)
    cross = 0
    for r in results:
        r["ids"] = np.unique(np.asarray(r["ids"], np.int64))
    per_shard_unique = np.concatenate([r["ids"] for r in results]) if results else np.zeros(0, np.int64)
    values, counts = np.unique(per_shard_unique, return_counts=True)
    repeated = values[counts > 1]
    if repeated.size:
        cross = int((counts[counts > 1] - 1).sum())
        for value in repeated[:MAX_EXAMPLES - len(examples["duplicate_keys"])]:
            examples["duplicate_keys"].append(str(int(value)))
    report["duplicate_keys"] += cross

    id_space = int(manifest.get("id_space", 0) or 0)
    report["id_space"] = id_space
    report["ids_outside_id_space"] = int((all_ids >= id_space).sum()) if id_space else 0
    report["max_id"] = int(all_ids.max()) if all_ids.size else None

    report["unreadable_shards"] = [{"shard": r["shard"], "error": r["error"], "samples_read": r["samples"]}
                                   for r in results if r["error"]]
    report["size_mismatches"] = [{"shard": r["shard"], "sizes_json": sizes[r["shard"]], "found": r["samples"]}
                                 for r in results if r["shard"] in sizes and sizes[r["shard"]] != r["samples"]]
    report["examples"] = examples
    report["shards"] = {r["shard"]: {"samples": r["samples"], "error": r["error"],
                                     **{kind: r[kind] for kind in PROBLEMS}} for r in results}
    report["ok"] = not report["unreadable_shards"] and not report["size_mismatches"] and not any(
        report[kind] for kind in PROBLEMS) and not report["ids_outside_id_space"]
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["summary"] = summarize(report)

    if report_path is None and directory is not None and os.path.isdir(str(dir_or_pattern)):
        report_path = directory / REPORT_FILE
    if report_path is not None:
        report["report_path"] = str(report_path)
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        with open(report_path, "w") as f:
            json.dump(report, f, indent=2)
    if progress:
        print(report["summary"], file=sys.stderr)
    return report


def summarize(report: dict[str, Any]) -> str:
    """One line: the counts that matter, and the verdict."""
    parts = [f"{report['num_shards']} shards", f"{report['num_samples']} samples"]
    for kind in PROBLEMS + ("ids_outside_id_space",):
        if report.get(kind):
            parts.append(f"{report[kind]} {kind.replace('_', ' ')}")
    if report["size_mismatches"]:
        parts.append(f"{len(report['size_mismatches'])} shards disagree with sizes.json")
    if report["unreadable_shards"]:
        names = ", ".join(u["shard"] for u in report["unreadable_shards"][:5])
        parts.append(f"{len(report['unreadable_shards'])} UNREADABLE shards ({names})")
        verdict = "FAILED"
    else:
        verdict = "ok" if report["ok"] else "readable, with problems"
    return f"check: {verdict}: " + ", ".join(parts)
