"""``vlcontrast study``: a grid of short trainings (v1) or the staged, tuned study (v2, a config
with ``datasets:``)."""

from __future__ import annotations

from pathlib import Path

from vlcontrast.cli.environment import prepare_environment


def register(sub) -> None:
    study = sub.add_parser("study", help="grid of short runs: loss x batch size x seed")
    study.add_argument("--config", required=True)
    study.add_argument("--report-only", action="store_true",
                       help="rebuild the CSV, tables and plots from the stored cell results")
    study.add_argument("--stage", default="all",
                       choices=("prepare", "sweep", "final", "report", "all"),
                       help="v2 studies: run one stage (docs/loss-study-v2.md)")
    study.add_argument("--plan", action="store_true",
                       help="v2 studies: print the cells of each stage and the machine time")
    study.add_argument("--rerun", nargs="+", default=[], metavar="CELL",
                       help="v2 studies: train these finished cells again (scratch directory) "
                            "and compare with their committed results bit for bit")
    study.add_argument("--sync-docs", nargs="+", default=[], metavar="PAGE",
                       help="v2 studies: after the report, rewrite the generated blocks "
                            "(findings, recommendation) of these markdown pages from the cells")
    study.add_argument("overrides", nargs="*")
    study.set_defaults(func=run_study_command)


def run_study_command(args) -> int:
    prepare_environment()
    from vlcontrast.study import load_study_config, run_study

    config = load_study_config(args.config, args.overrides)
    if config.datasets:  # study v2: stages (vlcontrast/study/v2.py)
        import shlex

        from vlcontrast.study.v2 import plan_text, run_study_v2

        if args.plan:
            print(plan_text(config))
            return 0
        if args.rerun:
            from vlcontrast.study.v2 import rerun_cells

            try:
                return rerun_cells(config, args.rerun)
            except ValueError as err:
                raise SystemExit(str(err)) from None
        stage = "report" if args.report_only else args.stage
        pages = tuple(Path(page) for page in args.sync_docs)
        for page in pages:
            if not page.is_file():
                raise SystemExit(f"--sync-docs {page}: no such file; name markdown pages that "
                                 "hold generated study blocks (docs/loss-study-v2.md)")
        if pages and stage not in ("final", "report", "all"):
            raise SystemExit(f"--sync-docs: stage {stage!r} writes no report; use --stage report")
        run_study_v2(config, stage, "vlcontrast study --config "
                     + shlex.join([args.config, *args.overrides]), pages)
        return 0
    if args.plan or args.stage != "all" or args.sync_docs or args.rerun:
        raise SystemExit("--plan, --stage, --rerun and --sync-docs apply to v2 studies (a config "
                         "with datasets:)")
    run_study(args.config, args.overrides, report_only=args.report_only)
    return 0

