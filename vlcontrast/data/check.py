"""Shard check: read every sample of every shard and report what a training run would skip.

:func:`check_shards` reads shards with the same tar reader (:mod:`.tar_reader`) and judges every
sample with the same function (:func:`.samples.inspect_sample`) as the training loader and
evaluation, so its counts use the same names and mean the same samples: every class the loader
skips (``missing_image``, ``undecodable_image``, ``decompression_bomb``, ``missing_caption``,
``caption_not_utf8``, ``empty_caption``, ``no_sample_id``, ``sample_id_out_of_range``), plus
``duplicate_key`` (a key seen twice in one shard, or an id in two shards of one directory) and
``invalid_json``, which no reader skips. Shard-level findings: shards a directory's size source
(``sizes.json``, ``manifest.json``, ``*_stats.json``) lists but that are absent (training reads the
shards present, with a warning: they fail ``ok``, not ``trainable``), counts that disagree with
``sizes.json``, truncated shards, unreadable shards, and a folder an unfinished ``vlcontrast prep``
run is writing (training refuses it: not ``trainable``). When most samples lack the image or the
caption member, the summary names the members they have and the key that reads them. The one
class of the loader the check cannot see is ``transform_error`` (it depends on the model's
transform).

A shard that ends early is judged as training judges it, by the same header count
(:func:`.counting.count_shard`, which :func:`.sources.resolve_shard_set` uses): one that merely
stops before its end-of-archive block is *truncated* -- its complete samples are counted and used,
with the trainer's warning -- while one whose headers are damaged (not a tar at all, garbage) is
*unreadable*. Where the sizes training would use (``sizes.json``, ``manifest.json``, img2dataset
``*_stats.json``) list more rows than a shard delivers, the shortfall is counted as
``missing_samples`` and enters the bad-sample fraction, as it does in the training loader.

The input is any shard spec of :mod:`.spec` (a directory, a pattern, a comma list, ...). The
report is JSON (``DIR/check_report.json`` when a directory was given; ``--json`` prints it);
``vlcontrast prep check`` exits 1 when the shards would not train: a shard is unreadable, or more
than ``--max-bad-fraction`` of the samples would be skipped or missing (``trainable`` in the
report); a truncated shard alone does not fail the check.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from vlcontrast.errors import DataPrepError

from .samples import (CHECK_ONLY_REASONS, CONTENT_REASONS, DEFAULT_MAX_IMAGE_PIXELS,
                      DEFAULT_MEMBERS, ID_REASONS, IdRule, Members, check_member_keys, count,
                      find_image, inspect_sample, read_caption, read_json, read_sample_id)
from .counting import count_shard
from .shards import read_manifest, read_sizes, unfinished_prep
from .sources import (directory_sizes, missing_listed_shards, missing_shards_line,
                      warn_incomplete, whole_directories)
from .spec import IMAGE_FILE_EXTENSIONS, expand_spec
from .tar_reader import PIPE_PREFIX, read_shard

MAX_EXAMPLES = 10
DEFAULT_MAX_BAD_FRACTION = 0.05
"""``data.max_bad_fraction``'s default: the check fails where training would stop."""
REPORT_FILE = "check_report.json"
PROBLEMS = tuple(r for r in CONTENT_REASONS if r != "transform_error") + ID_REASONS + \
    CHECK_ONLY_REASONS
"""Every per-sample class the check counts (the loader's names)."""


def _id_space(directory: str) -> int:
    try:
        return int(read_manifest(directory).get("id_space", 0) or 0)
    except (FileNotFoundError, ValueError):
        return 0


KEY_REASONS = {"missing_caption": "caption", "missing_image": "image"}
"""The per-sample reasons that mean no member matches ``data.caption_key``/``data.image_key``."""
SNIFF_SAMPLES = 8
"""Samples the training preflight reads (from the first local shards) to check the member keys."""


def key_hint(key: str, members: dict[str, bytes], reason: str) -> dict[str, Any]:
    """What a sample that is ``missing_caption``/``missing_image`` holds instead: ``found`` (its
    members, and for a caption a ``.json``'s caption field) and ``setting``, the key that would
    read it (``json:caption``, ``gif``), or None. A caption field is looked for as ``prep
    folder`` reads a ``.json`` sidecar (its ``SIDECAR_KEYS``, first present wins)."""
    from .prep.folder import SIDECAR_KEYS

    names = ", ".join("." + ext for ext in sorted(members)) or "no members"
    found = f"sample {key!r} has {names}"
    setting = None
    if reason == "missing_caption":
        meta = read_json(members)
        if isinstance(meta, dict):
            field = next((f for f in SIDECAR_KEYS
                          if read_caption(members, (f"json:{f}",)) not in
                          ("missing_caption", "empty_caption", "caption_not_utf8")), None)
            if field is not None:
                found += f"; its .json has {field!r}"
                setting = f"json:{field}"
        if setting is None:
            setting = next((ext for ext in SIDECAR_KEYS if ext in members), None)
    elif reason == "missing_image":
        extensions = tuple(e.lstrip(".") for e in IMAGE_FILE_EXTENSIONS)
        setting = next((ext for ext in sorted(members) if ext in extensions), None)
    return {"key": key, "found": found, "setting": setting}


def key_fix(reason: str, hint: dict[str, Any] | None, option: str) -> str:
    """``set data.caption_key=json:caption`` (``option``: ``data.caption_key``, or the check's
    ``--caption-key``), or what to set it to when no member looks right."""
    if hint and hint.get("setting"):
        return f"set {option}={hint['setting']}"
    if reason == "missing_caption":
        return (f"set {option} to the member holding the caption (txt, or json:FIELD for a "
                "field of the .json)")
    return f"set {option} to the image member's extension (e.g. jpg;png)"


def sniff_member_keys(urls: list[str], keys: Members, key: str = "data.train",
                      samples: int = SNIFF_SAMPLES,
                      options: tuple[str, str] = ("data.image_key", "data.caption_key")
                      ) -> str | None:
    """The training preflight's look at the first ``samples`` samples of the first local shards
    (``pipe:`` and missing shards are passed over; an unreadable shard just ends the look): when
    none of them has a member matching ``data.image_key`` or ``data.caption_key``, the one-line
    error naming the shard, the members found and the setting to use; else None. ``key`` names
    the shards, ``options`` the two settings (``--image-key``, ``--caption-key`` for ``eval
    retrieval``)."""
    seen = 0
    lacking = {"missing_image": 0, "missing_caption": 0}
    first: dict[str, tuple[str, dict[str, Any]]] = {}
    for url in urls:
        if seen >= samples:
            break
        if url.startswith(PIPE_PREFIX) or not os.path.isfile(url):
            continue
        for _, row_key, members in read_shard(url, take=samples - seen, exact=False):
            seen += 1
            checks = {"missing_image": find_image(members, keys.image) is None,
                      "missing_caption": read_caption(members, keys.caption) == "missing_caption"}
            for reason, missing in checks.items():
                if missing:
                    lacking[reason] += 1
                    first.setdefault(reason, (url, key_hint(row_key, members, reason)))
    for reason, option, value in (("missing_image", options[0], ";".join(keys.image)),
                                  ("missing_caption", options[1], ";".join(keys.caption))):
        if seen and lacking[reason] == seen:
            url, hint = first[reason]
            return (f"{key}: none of the first {seen} samples of {url!r} has a member matching "
                    f"{option}={value!r} ({hint['found']}): {key_fix(reason, hint, option)}")
    return None


def check_shard(path: str, decode_images: bool = True, id_space: int = 0,
                max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS, require_ids: bool = True,
                keys: Members = DEFAULT_MEMBERS) -> dict[str, Any]:
    """Read one shard; never raises: a broken shard is reported in ``error``. Samples without a
    usable id are problems when ``require_ids`` or ``id_space`` (the loader's rule)."""
    result: dict[str, Any] = {"shard": os.path.basename(path), "path": path, "samples": 0,
                              "non_numeric_ids": 0,
                              "error": None, "truncated": None,
                              "bad_samples": {kind: 0 for kind in PROBLEMS},
                              "examples": {kind: [] for kind in PROBLEMS}, "ids": [],
                              "key_hints": {}}

    def problem(kind: str, key: str) -> None:
        count(result["bad_samples"], kind)
        if len(result["examples"][kind]) < MAX_EXAMPLES:
            result["examples"][kind].append(key)

    if not path.startswith("pipe:") and not os.path.exists(path):
        result["error"] = "missing: the shard file does not exist"
        return result
    keys_seen: set[str] = set()
    events: dict[str, int] = {}
    errors: list[str] = []
    rule = IdRule(0, id_space, required=require_ids or id_space > 0)
    for _, key, members in read_shard(path, counts=events, exact=False, errors=errors):
        result["samples"] += 1
        if key in keys_seen:
            problem("duplicate_key", key)
        keys_seen.add(key)
        if "json" in members and read_json(members) is None:
            problem("invalid_json", key)
        sample = inspect_sample(key, members, ids=rule, max_image_pixels=max_image_pixels,
                                decode_image=decode_images, keys=keys)
        if isinstance(sample, str):
            problem(sample, key)
            if sample in KEY_REASONS and sample not in result["key_hints"]:
                result["key_hints"][sample] = key_hint(key, members, sample)
        sample_id = read_sample_id(key, members, IdRule())  # for duplicates, whatever else failed
        if not isinstance(sample_id, str):
            result["ids"].append(sample_id)
        else:
            result["non_numeric_ids"] += 1
            result.setdefault("example_key", key)
    if events:
        # The trainer's judgement of a shard that ends early (sources.resolve_shard_set): a file
        # that merely stops before its end-of-archive block is truncated, and its complete
        # samples are used; damaged headers make it unreadable. pipe: shards cannot be counted
        # ahead, so any early end stays unreadable.
        found = None if path.startswith(PIPE_PREFIX) else count_shard(path)
        if found is not None and not found.complete and found.error is None:
            result["truncated"] = found
        else:
            result["error"] = f"unreadable after {result['samples']} samples: " + \
                "; ".join(errors)
    return result


def _check_job(job: tuple) -> dict[str, Any]:
    return check_shard(*job)


def _resolve(spec: str) -> tuple[list[str], list[dict[str, Any]]]:
    """Shards of the spec, and for each folder it names as a directory the shards its size source
    (``sizes.json``, else ``manifest.json``, else img2dataset's ``*_stats.json``, as training
    reads them) lists with samples but that are not there: training reads the shards present."""
    paths = expand_spec(spec, "prep check")
    missing = []
    for directory in whole_directories(spec, "prep check"):
        found = missing_listed_shards(directory)
        if found:
            missing.append({"directory": directory, "line": missing_shards_line(directory, found),
                            "shards": [{"shard": name, "path": os.path.join(directory, name),
                                        "listed_in": where, "samples": n}
                                       for name, n, where in found]})
    return paths, missing


def check_shards(dir_or_pattern: str | os.PathLike, report_path: str | os.PathLike | None = None,
                 progress: bool = True, *, workers: int = 1, decode_images: bool = True,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 max_bad_fraction: float = DEFAULT_MAX_BAD_FRACTION, require_ids: bool = False,
                 image_key: str = "", caption_key: str = "") -> dict[str, Any]:
    """Check every shard a spec names; write and return the JSON report.

    ``report_path`` defaults to ``DIR/check_report.json`` when a directory is given. ``workers``
    > 1 reads shards in parallel processes. ``progress`` shows a bar and prints a summary to
    stderr. The report's ``ok`` is false when any shard is unreadable or any sample has a
    problem. ``trainable`` (the CLI's exit status) is false when a shard is unreadable or more
    than ``max_bad_fraction`` of the samples would be skipped. Samples without a numeric id count
    as skipped where the loader would skip them: with ``require_ids`` (a loss that keeps
    per-sample state) or where a ``manifest.json`` declares the id space; ``ids`` reports how
    many keys are numeric either way. ``image_key``/``caption_key``: as ``data.image_key`` and
    ``data.caption_key``.
    """
    if not 0.0 <= max_bad_fraction <= 1.0:
        raise DataPrepError(f"prep check: --max-bad-fraction={max_bad_fraction}: must be in "
                            "[0, 1]")
    check_member_keys(image_key or "jpg", caption_key or "txt", "prep check")
    keys = Members.parse(image_key, caption_key)
    start = time.perf_counter()
    spec = str(dir_or_pattern)
    paths, missing_shards = _resolve(spec)
    directories = list(dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths
                                     if not p.startswith("pipe:")))
    unfinished = [line for line in map(unfinished_prep, directories) if line]
    sizes = {os.path.join(d, name): n for d in directories for name, n in read_sizes(d).items()}
    # The sizes training would take (sizes.json, else manifest.json, else *_stats.json): rows they
    # promise but a shard lacks are the loader's missing_samples.
    promised = {os.path.join(d, name): n for d in directories
                for name, n in directory_sizes(d).items()}
    spaces = {d: _id_space(d) for d in directories}

    bar = None
    if progress:
        from vlcontrast.progress import Progress  # a bar on a terminal, plain lines in a log

        bar = Progress(total=len(paths), unit="shard", desc=f"check {spec}")
    jobs = [(path, decode_images,
             spaces.get(os.path.dirname(os.path.abspath(path)), 0), max_image_pixels,
             require_ids, keys) for path in paths]
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

    report: dict[str, Any] = {"path": spec, "num_shards": len(results),
                              "num_samples": sum(r["samples"] for r in results)}
    bad = {kind: sum(r["bad_samples"][kind] for r in results) for kind in PROBLEMS}
    examples: dict[str, list[str]] = {kind: [] for kind in PROBLEMS}
    for r in results:
        for kind in PROBLEMS:
            examples[kind].extend(r["examples"][kind][:MAX_EXAMPLES - len(examples[kind])])

    # The same id in two shards of one directory (the loader offsets ids per directory).
    for directory in directories:
        in_directory = [r for r in results
                        if os.path.dirname(os.path.abspath(r["path"])) == directory]
        unique = [np.unique(np.asarray(r["ids"], np.int64)) for r in in_directory]
        values, counts = np.unique(np.concatenate(unique) if unique else np.zeros(0, np.int64),
                                   return_counts=True)
        if (counts > 1).any():
            bad["duplicate_key"] += int((counts[counts > 1] - 1).sum())
            for value in values[counts > 1][:MAX_EXAMPLES - len(examples["duplicate_key"])]:
                examples["duplicate_key"].append(str(int(value)))
    all_ids = [i for r in results for i in r["ids"]]

    report["bad_samples"] = bad
    report["id_space"] = sum(spaces.values()) if spaces and all(spaces.values()) else 0
    report["max_id"] = max(all_ids) if all_ids else None
    report["unreadable_shards"] = [{"shard": r["shard"], "error": r["error"],
                                    "samples_read": r["samples"]} for r in results if r["error"]]
    report["truncated_shards"] = [{"shard": r["shard"], "samples": r["samples"]}
                                  for r in results if r["truncated"]]
    for r in results:
        if r["truncated"]:
            warn_incomplete(r["path"], r["truncated"])  # the trainer's own warning
    missing = {r["shard"]: promised[os.path.abspath(r["path"])] - r["samples"] for r in results
               if not r["error"] and promised.get(os.path.abspath(r["path"]), 0) > r["samples"]}
    report["missing_samples"] = sum(missing.values())
    # Shards the sizes list but that are not there: training reads the shards present (with a
    # warning, sources.warn_missing_shards), so they fail ``ok`` but not ``trainable``.
    report["missing_shards"] = [shard for folder in missing_shards for shard in folder["shards"]]
    report["missing_shards_lines"] = [folder["line"] for folder in missing_shards]
    # A prep folder|csv|wds run that has not finished: training refuses it (train.preflight).
    report["unfinished_prep"] = unfinished
    hints: dict[str, dict[str, Any]] = {}
    for r in results:
        for reason, hint in r["key_hints"].items():
            hints.setdefault(reason, hint)
    report["key_hints"] = hints
    listed = {r["path"]: sizes.get(os.path.abspath(r["path"])) for r in results}
    report["size_mismatches"] = [
        {"shard": r["shard"], "sizes_json": listed[r["path"]], "found": r["samples"]}
        for r in results if listed[r["path"]] not in (None, r["samples"])]
    report["examples"] = examples
    report["shards"] = {r["shard"]: {"samples": r["samples"], "error": r["error"],
                                     "truncated": bool(r["truncated"]),
                                     "missing_samples": missing.get(r["shard"], 0),
                                     "bad_samples": {k: v for k, v in r["bad_samples"].items()
                                                     if v}} for r in results}
    report["ok"] = (not report["unreadable_shards"] and not report["size_mismatches"]
                    and not report["truncated_shards"] and not any(bad.values())
                    and not report["missing_shards"] and not unfinished)
    non_numeric = sum(r["non_numeric_ids"] for r in results)
    report["ids"] = {"numeric": report["num_samples"] - non_numeric, "non_numeric": non_numeric,
                     "required": bool(require_ids or any(spaces.values())),
                     "example_non_numeric": next((r["example_key"] for r in results
                                                  if r.get("example_key")), None)}
    # The loader's bad-sample rate (samples.bad_rate_error): missing rows count as bad ones.
    skipped_total = sum(v for k, v in bad.items() if k not in CHECK_ONLY_REASONS) + \
        report["missing_samples"]
    fraction = (skipped_total / (report["num_samples"] + report["missing_samples"])
                if report["num_samples"] else 1.0)
    report["bad_fraction"] = round(fraction, 6)
    report["max_bad_fraction"] = max_bad_fraction
    report["trainable"] = (not report["unreadable_shards"] and report["num_samples"] > 0
                           and fraction <= max_bad_fraction and not unfinished)
    if non_numeric and not report["ids"]["required"]:
        report["ids"]["note"] = (
            f"{non_numeric} keys are not numeric: fine for losses without per-sample state; a "
            "loss that keeps per-sample state (decl estimator=buffer) needs `vlcontrast prep wds "
            "SHARDS OUT` first")
    report["seconds"] = round(time.perf_counter() - start, 2)
    report["summary"] = summarize(report)

    if report_path is None and os.path.isdir(spec):
        report_path = Path(spec) / REPORT_FILE
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
    for kind, n in report["bad_samples"].items():
        if n:
            parts.append(f"{n} {kind}")
    if report.get("missing_samples"):
        parts.append(f"{report['missing_samples']} missing_samples (listed in the shards' sizes, "
                     "not in the shards)")
    if report["size_mismatches"]:
        parts.append(f"{len(report['size_mismatches'])} shards disagree with sizes.json")
    for line in report.get("missing_shards_lines") or []:
        parts.append(f"MISSING shards: {line}; training uses the shards that are there")
    truncated = report.get("truncated_shards") or []
    if truncated:
        names = ", ".join(f"{t['shard']}: {t['samples']}" for t in truncated[:5])
        parts.append(f"{len(truncated)} truncated shards, their complete samples used ({names})")
    if report["unreadable_shards"]:
        names = ", ".join(u["shard"] for u in report["unreadable_shards"][:5])
        parts.append(f"{len(report['unreadable_shards'])} UNREADABLE shards ({names})")
        verdict = "FAILED"
    else:
        verdict = "ok" if report["ok"] else "readable, with problems"
    if not report.get("trainable", True) and not report["unreadable_shards"]:
        verdict = (f"WOULD NOT TRAIN ({report.get('bad_fraction', 1.0):.1%} of samples skipped "
                   f"or missing > --max-bad-fraction={report.get('max_bad_fraction', 0):.1%})")
    ids = report.get("ids") or {}
    if ids.get("non_numeric") and not ids.get("required"):
        parts.append(f"{ids['non_numeric']} non-numeric keys (fine unless the loss needs ids: "
                     "then `vlcontrast prep wds`)")
    hint = key_hint_line(report)
    if hint:
        parts.append(hint)
    if report.get("unfinished_prep"):
        verdict = "UNFINISHED PREP: " + "; ".join(report["unfinished_prep"])
    return f"check: {verdict}: " + ", ".join(parts)


def key_hint_line(report: dict[str, Any]) -> str:
    """When most samples are ``missing_caption``/``missing_image``: what they hold and the
    setting that reads them (``--caption-key json:caption``, ``data.caption_key`` in training);
    else an empty string."""
    bad = report.get("bad_samples") or {}
    samples = report.get("num_samples") or 0
    for reason, what in KEY_REASONS.items():
        if samples and bad.get(reason, 0) * 2 > samples:
            hint = (report.get("key_hints") or {}).get(reason)
            fix = key_fix(reason, hint, f"--{what}-key")
            setting = (f" (data.{what}_key={hint['setting']} in training)"
                       if hint and hint.get("setting") else "")
            found = f" ({hint['found']})" if hint else ""
            return (f"most samples have no member matching --{what}-key{found}: "
                    f"{fix}{setting}")
    return ""
