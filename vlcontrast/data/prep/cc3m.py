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

img2dataset runs in a child process of its own process group: Ctrl-C (SIGINT to the terminal's
process group) or SIGTERM reaches this process, which passes SIGINT on to that group, waits
:data:`STOP_GRACE_S` and then kills what is left. An interrupted download raises
:class:`DownloadInterrupted` (exit status 130, after one line on stderr) and writes no manifest:
the earlier ``manifest.json``/``sizes.json`` are only moved aside during the download and are put
back. A download that got (almost) nothing raises :class:`DownloadFailed` (exit status 1) naming
the top error and its likely cause; when the first finished shard got nothing and failed with
network errors (no DNS, connection refused), the download is stopped there.
Settings and numbers: ``docs/data.md``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vlcontrast.errors import DataPrepError, VlcontrastError

from ..naming import key_stride, shard_name
from ..shards import MANIFEST_FILE, SIZES_FILE, build_manifest, write_manifest, write_sizes
from .writer import prepare_layout, remove_earlier_prep, resolve_inputs

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
_ASIDE = "_aside"
_FAILED_SUFFIX = ".failed"

STOP_GRACE_S = 30.0
"""Seconds img2dataset gets to stop after SIGINT before its processes are killed."""
MIN_SUCCESS_RATE = 0.01
"""A download whose shards of this run got fewer than this fraction of their URLs is a failure."""
_NETWORK_ERRORS = (
    ("no_dns", re.compile(r"Name or service not known|Temporary failure in name resolution|"
                          r"nodename nor servname|getaddrinfo failed|No address associated",
                          re.IGNORECASE),
     "the host names do not resolve: this machine seems to have no network or DNS (or these "
     "hosts are blocked); connect it (or set https_proxy/http_proxy if it must use a proxy)"),
    ("unreachable", re.compile(r"Connection refused|Network is unreachable|No route to host|"
                               r"Tunnel connection failed|ProxyError|Cannot connect to proxy",
                               re.IGNORECASE),
     "the hosts cannot be reached: a firewall, or a proxy is needed (set https_proxy/http_proxy)"),
)
_TIMEOUT_HINT = ("the hosts do not answer in time: blocked hosts or a slow link; retry later or "
                 "raise --timeout")


class DownloadInterrupted(SystemExit):
    """Ctrl-C (or SIGTERM) during the download: exit status 130. The finished shards are kept,
    no manifest is written (an earlier one is put back); ``message`` says how to continue."""

    def __init__(self, message: str, code: int = 130):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class DownloadFailed(VlcontrastError, RuntimeError):
    """The download ran but got (almost) nothing, or img2dataset itself failed: exit status 1."""


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
    """Move (rename) non-stats ``*.json`` files into ``OUT/_aside`` out of img2dataset's way.

    img2dataset's incremental mode takes ``int(name.split("_")[0])`` of *every* ``OUT/*.json`` to
    find finished shards, so ``sizes.json`` or a check report there makes a re-run crash. Nothing
    is deleted: :func:`_put_back` returns them (``sizes.json``/``manifest.json`` only when the
    download did not complete; a complete one writes new ones). Files still in ``_aside`` from a
    run that was killed are taken over (put back with this run's).
    """
    moved: list[tuple[Path, Path]] = []
    aside = out / _ASIDE
    if aside.is_dir():
        for target in sorted(aside.iterdir()):
            original = out / target.name
            if target.is_file() and not original.exists():
                moved.append((target, original))
    for path in sorted(out.glob("*.json")):
        if _STATS_FILE.match(path.name):
            continue
        aside.mkdir(exist_ok=True)
        target = aside / path.name
        os.replace(path, target)
        moved.append((target, path))
    return moved


def _put_back(out: Path, moved: list[tuple[Path, Path]], *, replaced: bool) -> None:
    """Return the files :func:`_set_aside_json` moved; with ``replaced`` (new ``sizes.json`` and
    ``manifest.json`` were written) the earlier two are dropped instead."""
    for target, original in moved:
        if not target.exists():
            continue
        if replaced and original.name in (SIZES_FILE, MANIFEST_FILE):
            target.unlink()
        else:
            os.replace(target, original)
    aside = out / _ASIDE
    if aside.is_dir() and not any(aside.iterdir()):
        aside.rmdir()


def _finished_shards(out: Path) -> dict[int, dict[str, Any]]:
    stats = {}
    for path in out.glob("*_stats.json"):
        match = _STATS_FILE.match(path.name)
        if match:
            with open(path) as f:
                stats[int(match.group(1))] = json.load(f)
    return stats


def _remove_unfinished(out: Path) -> list[str]:
    """Shard files (``.tar``, ``.parquet``) without a ``_stats.json``: what an interrupted
    img2dataset was writing. A re-run writes them again from the start."""
    finished = set(_finished_shards(out))
    removed = []
    for path in sorted(out.iterdir()):
        stem = path.name.split(".")[0]
        if stem.isdigit() and path.suffix in (".tar", ".parquet") and int(stem) not in finished:
            path.unlink()
            removed.append(path.name)
    return removed


def _network_hint(message: str) -> str | None:
    for _, pattern, hint in _NETWORK_ERRORS:
        if pattern.search(message):
            return hint
    return None


def _likely_cause(message: str) -> str:
    hint = _network_hint(message)
    if hint:
        return hint
    if re.search(r"timed out|timeout", message, re.IGNORECASE):
        return _TIMEOUT_HINT
    return ("check a few of the URLs by hand (the shards' *_stats.json list every error); "
            "if they work in a browser, retry later")


def _top_errors(stats: list[dict[str, Any]]) -> dict[str, int]:
    errors: dict[str, int] = {}
    for shard in stats:
        for message, n in (shard.get("status_dict") or {}).items():
            if message != "success":
                errors[message] = errors.get(message, 0) + int(n)
    return dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10])


def _img2dataset_child() -> None:
    """The child process: ``img2dataset.download(**json from stdin)``; exit 130 when
    img2dataset's own SIGINT handler ends it (that handler calls ``sys.exit(0)``)."""
    options = json.load(sys.stdin)
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import img2dataset

    try:
        img2dataset.download(**options)
    except SystemExit:
        sys.stdout.flush()
        os._exit(130)


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _run_img2dataset(options: dict[str, Any], out: Path, done_before: set[int]
                     ) -> tuple[str, dict[str, Any] | None]:
    """Run img2dataset in a child process group. Returns ``("done", None)``,
    ``("interrupted", None)``, or ``("network", stats)`` when the first shard finished in this run
    got nothing with network errors (the download is then stopped)."""
    root = str(Path(__file__).resolve().parents[3])  # the folder holding the package
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    env.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    group = ({"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True})
    received: list[int] = []

    def on_signal(signum, frame):  # noqa: ARG001
        received.append(signum)
        _signal_group(proc, signal.SIGINT)

    proc = subprocess.Popen(
        [sys.executable, "-c",
         "from vlcontrast.data.prep.cc3m import _img2dataset_child; _img2dataset_child()"],
        stdin=subprocess.PIPE, env=env, **group)
    previous: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                previous[signum] = signal.signal(signum, on_signal)
            except ValueError:  # not the main thread: the caller handles signals
                break
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(options).encode())
        proc.stdin.close()
        stop_at: float | None = None
        network: dict[str, Any] | None = None
        watch = True
        while True:
            try:
                proc.wait(timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                pass
            if (received or network) and stop_at is None:
                stop_at = time.monotonic() + STOP_GRACE_S
            if stop_at is not None and time.monotonic() > stop_at:
                _signal_group(proc, signal.SIGKILL)
            if watch and not received and network is None:
                new = {i: s for i, s in _finished_shards(out).items() if i not in done_before}
                if any(int(s.get("successes", 0)) > 0 for s in new.values()):
                    watch = False
                elif new:
                    first = new[min(new)]
                    top = next(iter(_top_errors([first])), "")
                    if _network_hint(top):
                        network = first
                        _signal_group(proc, signal.SIGINT)
                    else:
                        watch = False
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:  # an error in this process: do not leave the download running
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    if network is not None:
        return "network", network
    if received or proc.returncode == 130 or proc.returncode == -signal.SIGINT:
        return "interrupted", None
    if proc.returncode != 0:
        raise DownloadFailed(f"img2dataset stopped with exit status {proc.returncode} (its "
                             f"messages are above); the finished shards in {str(out)!r} are "
                             "kept: re-run the same command to continue")
    return "done", None


def prepare_cc3m(tsv: str | os.PathLike, out_dir: str | os.PathLike, *,
                 processes: int | None = None, threads: int = 64,
                 image_size: int = CC3M_SETTINGS["image_size"],
                 resize_mode: str = CC3M_SETTINGS["resize_mode"],
                 number_sample_per_shard: int = CC3M_SETTINGS["number_sample_per_shard"],
                 timeout: int = CC3M_SETTINGS["timeout"], retries: int = CC3M_SETTINGS["retries"],
                 encode_quality: int = CC3M_SETTINGS["encode_quality"],
                 user_agent_token: str | None = CC3M_SETTINGS["user_agent_token"],
                 disallowed_header_directives: list[str] | None = None,
                 incremental: bool = True, command: str = "prep cc3m",
                 manifest_extra: dict[str, Any] | None = None,
                 inputs: list[str | os.PathLike] | None = None) -> dict[str, Any]:
    """Download a CC3M TSV into webdataset shards in ``out_dir``; returns the manifest plus run info.

    ``processes``/``threads``: img2dataset download processes and threads per process.
    ``incremental=False`` deletes what an earlier prep wrote in ``out_dir`` first (its shards and
    metadata, :func:`~.writer.remove_earlier_prep`; the parquet is kept) and its shard sets in
    ``out_dir/train`` and ``out_dir/val``; shard files no prep recorded are refused.
    The returned dict is ``manifest.json`` plus ``shards_done_before`` (finished shards found at
    start), ``shards_written`` (finished in this call), ``incomplete_shards`` and ``seconds``.
    ``command`` names the caller in messages; ``manifest_extra`` adds manifest fields (its
    ``source`` replaces ``"img2dataset"``). ``inputs``: more files this run reads (``prep csv``'s
    table); neither they nor ``tsv`` are ever removed (an overwrite that would is refused).

    Raises :class:`DownloadInterrupted` on Ctrl-C/SIGTERM (no manifest written, the earlier one
    put back) and :class:`DownloadFailed` when the shards of this run got under
    :data:`MIN_SUCCESS_RATE` of their URLs, or the first of them got nothing with network errors
    (the download then stops there); the finished shards are kept either way.
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

    import importlib.util

    if importlib.util.find_spec("img2dataset") is None:
        raise DataPrepError(f"{command}: img2dataset is not installed; pip install "
                            "'vlcontrast[prep]'")
    start = time.perf_counter()
    out = Path(out_dir).resolve()
    # An earlier prep's shards in another layout (OUT/train, OUT/val) are refused, or removed
    # with --overwrite, which also removes what a prep wrote in OUT (its recorded shards and
    # metadata; shard files no prep recorded are refused), before the download cache is made.
    protected = resolve_inputs([tsv, *(inputs or [])]) if not incremental else frozenset()
    prepare_layout(out, split=False, overwrite=not incremental, command=command,
                   inputs=protected)
    out.mkdir(parents=True, exist_ok=True)
    if not incremental:
        remove_earlier_prep(out, command, target=True, inputs=protected)
    source = _convert_to_parquet(tsv, layout, out / "_input")
    done_before = set(_finished_shards(out))
    options = dict(
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
    again = f"re-run the same command to continue (finished shards in {str(out)!r} are skipped)"
    moved = _set_aside_json(out)
    replaced = False
    try:
        outcome, network = _run_img2dataset(options, out, done_before)
        if outcome == "interrupted":
            _remove_unfinished(out)
            kept = len(_finished_shards(out))
            message = (f"{command}: interrupted; {kept} finished shards are kept and no manifest "
                       f"was written; {again}")
            print(message, file=sys.stderr, flush=True)
            raise DownloadInterrupted(message)
        finished = _finished_shards(out)
        new = {i: s for i, s in finished.items() if i not in done_before}
        attempted = sum(int(s.get("count", 0)) for s in new.values())
        successes = sum(int(s.get("successes", 0)) for s in new.values())
        if network is not None or (attempted and successes < MIN_SUCCESS_RATE * attempted):
            _remove_unfinished(out)
            for i, stats in new.items():  # a re-run downloads these again
                if int(stats.get("successes", 0)) == 0:
                    name = out / f"{shard_name(i).split('.')[0]}_stats.json"
                    os.replace(name, name.with_name(name.name + _FAILED_SUFFIX))
            top = next(iter(_top_errors(list(new.values()))), "no status recorded")
            count = sum(_top_errors(list(new.values())).values())
            if network is not None:
                what = (f"stopped after the first shard: all {int(network.get('count', 0))} URLs "
                        "failed")
            else:
                what = (f"{successes} of {attempted} URLs downloaded (under "
                        f"{MIN_SUCCESS_RATE:.0%})")
            raise DownloadFailed(
                f"{command}: {what}; top error {top!r} ({count} times): {_likely_cause(top)}; "
                f"no manifest was written; once fixed, re-run the same command (the shards in "
                f"{str(out)!r} that got images are kept, the others are tried again)")
        incomplete = [shard_name(i) for i in range(-(-source["rows"] // number_sample_per_shard))
                      if i not in finished]
        sizes = {shard_name(i): int(stats["successes"]) for i, stats in finished.items()}
        totals = {k: sum(int(s.get(k, 0)) for s in finished.values())
                  for k in ("count", "successes", "failed_to_download", "failed_to_resize")}
        extra = dict(manifest_extra or {})
        manifest = build_manifest(
            sizes, stride=key_stride(number_sample_per_shard),
            source=extra.pop("source", "img2dataset"),
            tsv=str(tsv.resolve()), tsv_rows=source["rows"],
            tsv_skipped_rows=source["skipped_rows"],
            attempted=totals["count"], failed_to_download=totals["failed_to_download"],
            failed_to_resize=totals["failed_to_resize"],
            success_rate=(round(totals["successes"] / totals["count"], 4) if totals["count"]
                          else 0.0),
            top_errors=_top_errors(list(finished.values())),
            incomplete_shards=incomplete,
            **extra,
            settings={"image_size": image_size, "resize_mode": resize_mode,
                      "encode_quality": encode_quality,
                      "number_sample_per_shard": number_sample_per_shard,
                      "timeout": timeout, "retries": retries, "user_agent_token": user_agent_token,
                      "img2dataset": _img2dataset_version()},
        )
        if sizes:
            write_sizes(out, sizes)
        write_manifest(out, manifest)
        replaced = True
    finally:
        _put_back(out, moved, replaced=replaced)
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
