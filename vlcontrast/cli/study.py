"""``vlcontrast study``: the study engine's command (vlcontrast/study/engine.py): a grid of short
trainings (v1) or a staged, tuned study (a config with ``datasets:``), its plan, one cell (a SLURM
array task's work) or the cells that can run now."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlcontrast.cli.environment import prepare_environment
from vlcontrast.cli.train import OneConfig
from vlcontrast.errors import ConfigError


def register(sub) -> None:
    study = sub.add_parser("study", help="compare losses: a staged design (tuned lr, seeds, Holm) or a grid of short runs (loss x batch size x seed); --plan prices it")
    study.add_argument("--config", required=True, action=OneConfig)
    study.add_argument("--report-only", action="store_true",
                       help="rebuild the CSV, tables and plots from the stored cell results")
    study.add_argument("--stage", default="all", type=stage_name,
                       help="prepare | sweep | final | report | all: run one stage "
                            "(docs/loss-study-v2.md); sweep runs the plan's sweep-lr and "
                            "sweep-hyper parts")
    study.add_argument("--plan", action="store_true",
                       help="print the cells of each stage and their machine time (CPU model or "
                            "measured GPU step times, cost_model)")
    study.add_argument("--list-cells", action="store_true",
                       help="print the names of the cells that can run now (a SLURM array's list)")
    # action="extend": each of these may be given more than once and adds to the list (argparse's
    # plain "store" kept the last one, so --cell a --cell b ran b alone without a word).
    study.add_argument("--cell", nargs="+", action="extend", default=[], metavar="CELL",
                       help="run these cells only (skipped when finished): one array task's "
                            "work (repeatable: --cell a --cell b runs both)")
    study.add_argument("--rerun", nargs="+", action="extend", default=[], metavar="CELL",
                       help="v2 studies: train these finished cells again (scratch directory) "
                            "and compare with their committed results bit for bit")
    study.add_argument("--sync-docs", nargs="+", action="extend", default=[], metavar="PAGE",
                       help="v2 studies: after the report, rewrite the generated blocks "
                            "(findings, recommendation) of these markdown pages from the cells")
    study.add_argument("overrides", nargs="*")
    study.set_defaults(func=run_study_command)


STUDY_STAGES = ("prepare", "sweep", "final", "report", "all")


def stage_name(value: str) -> str:
    """``--stage``: one of :data:`STUDY_STAGES`; a part that ``--plan`` prints (``sweep-lr``) is
    refused with the stage that runs it."""
    from vlcontrast.study.design import STAGE_OF_PART

    if value in STUDY_STAGES:
        return value
    if value in STAGE_OF_PART:
        runs = STAGE_OF_PART[value]
        parts = [part for part, stage in STAGE_OF_PART.items() if stage == runs]
        raise argparse.ArgumentTypeError(
            f"{value!r} is a part of --stage {runs}, which runs {' then '.join(parts)}; "
            f"use --stage {runs}")
    raise argparse.ArgumentTypeError(f"{value!r} is not a stage; use one of "
                                     f"{', '.join(STUDY_STAGES)}")


def run_study_command(args) -> int:
    prepare_environment()
    import shlex

    from vlcontrast.study import engine, load_study_config
    from vlcontrast.study.config import check_data

    if Path(args.config).is_dir():  # not "does not exist": it does, as a folder
        from vlcontrast.config import name_a_yaml_file_in

        raise ConfigError(f"study config {args.config!r} is a directory; "
                          f"{name_a_yaml_file_in(Path(args.config))}")
    config = load_study_config(args.config, args.overrides)
    folder = Path(args.config).parent  # relative data paths were looked up there too
    if args.plan:  # counts only: fine with the shipped placeholder paths
        print(engine.plan_text(config))
        return 0
    if args.list_cells:  # what a SLURM array runs next (slurm/study.sh)
        list_cells(config, folder)
        return 0
    if args.cell or args.rerun:  # they train: the data must be there first
        check_data(config, folder)
    if args.cell:
        try:
            # a cell named twice runs once, in the order first named
            cells = [engine.find_cell(config, name) for name in dict.fromkeys(args.cell)]
        except ValueError as err:
            raise ConfigError(str(err)) from None
        failed = 0
        for cell in cells:
            if engine.is_finished(config, cell):
                print(f"study: {cell.name} already finished (its fingerprint matches)",
                      file=sys.stderr)
                continue
            record = engine.run_one(config, cell)
            # "busy": another live task runs it (its one line said which); not this task's failure
            failed += record["status"] not in ("ok", "busy")
            print(f"study: {cell.name} {record['status']} ({record['wall_s']} s)", file=sys.stderr)
        return 1 if failed else 0
    if args.rerun:
        from vlcontrast.study.v2 import rerun_cells

        if not config.datasets:
            raise ConfigError("--rerun applies to staged studies (a config with datasets:); "
                              f"{args.config} is a grid study")
        try:
            return rerun_cells(config, list(dict.fromkeys(args.rerun)))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    stage = "report" if args.report_only else args.stage
    if stage == "sweep" and not config.datasets:  # a grid tunes nothing: it ran no cell
        raise ConfigError(f"--stage sweep: {args.config} is a grid study (no datasets:), which "
                          "has no sweep; run its cells with --stage final or --stage all (the "
                          "default)")
    pages = tuple(Path(page) for page in args.sync_docs)
    for page in pages:
        if not page.is_file():
            raise ConfigError(f"--sync-docs {page}: no such file; name markdown pages that "
                             "hold generated study blocks (docs/loss-study-v2.md)")
    if pages and (stage not in ("final", "report", "all") or not config.datasets):
        raise ConfigError(f"--sync-docs: needs a staged study (datasets:) and a stage that writes "
                         f"the report (--stage report), not {stage!r}")
    try:
        engine.run_study(config, stage, "vlcontrast study --config "
                         + shlex.join([args.config, *args.overrides]), pages, folder)
    except engine.StudyStopped as stopped:  # kill (SIGTERM): the running cells checkpointed
        print(stopped.line(), file=sys.stderr, flush=True)
        return 128 + stopped.signum  # the shell's status for a command ended by that signal
    return 0


def list_cells(config, folder: Path) -> None:
    """``--list-cells``: the names of the cells that can run now on stdout, and one line on
    stderr: how many and which part of which ``--stage``, or why they cannot run yet (a data path
    that does not exist, such as the shipped ``/path/to/...`` placeholders)."""
    from vlcontrast.study import engine
    from vlcontrast.study.design import part_label
    from vlcontrast.study.config import data_problem

    part, cells = engine.next_round(config)
    print("\n".join(cell.name for cell in cells), end="\n" if cells else "")
    problem = data_problem(config, folder) if cells else None
    if problem:
        print(f"study: note: the {len(cells)} cell(s) listed, {part_label(part)}, cannot run "
              f"yet: {problem}", file=sys.stderr)
    else:
        print(f"study: {len(cells)} cell(s) can run now: {part_label(part)}", file=sys.stderr)
