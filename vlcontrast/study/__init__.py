"""The loss study: a grid of short training runs (loss x global batch size x seed) and its report.

``vlcontrast study --config configs/study/<name>.yaml [key=value ...]`` reads a
:class:`StudyConfig`, makes the dataset if it is missing, runs every unfinished cell as its own
training subprocess, stores one small result file per finished cell, and rebuilds the report
(CSV, tables with confidence intervals and paired comparisons, plots) after every cell.
See ``docs/loss-study.md``.

Modules: :mod:`.config` (the study's typed config), :mod:`.grid` (cells, overrides, learning-rate
rule, fingerprints), :mod:`.cells` (running a cell, its result file), :mod:`.stats` (t intervals,
paired t, Holm-Bonferroni, detectable difference), :mod:`.report` (CSV, markdown, plots), :mod:`.runner`
(``run_study``).
"""

from .cells import ensure_pretrained, is_finished, read_result, result_path, run_cell, summarise_run
from .config import StudyConfig, StudyData, StudyGrid, StudyPretrain, load_study_config
from .grid import (Cell, cell_command, cell_fingerprint, cell_learning_rate, cell_overrides,
                   data_overrides, grid_cells, pretrain_command, pretrain_dir)
from .report import collect_rows, comparison_family, markdown_tables, write_csv, write_report
from .runner import StudyResult, prepare_data, run_study
from .stats import (holm_adjust, mean_interval, minimum_detectable_difference, paired_comparison,
                    t_quantile, t_two_sided_p)

__all__ = [
    "Cell", "StudyConfig", "StudyPretrain", "ensure_pretrained", "pretrain_command", "pretrain_dir", "StudyData", "StudyGrid", "StudyResult", "cell_command",
    "cell_fingerprint", "cell_learning_rate", "cell_overrides", "collect_rows", "data_overrides",
    "comparison_family", "grid_cells", "holm_adjust", "is_finished", "load_study_config", "markdown_tables", "mean_interval",
    "minimum_detectable_difference", "paired_comparison", "prepare_data", "read_result",
    "result_path", "run_cell", "run_study", "summarise_run", "t_quantile", "t_two_sided_p", "write_csv",
    "write_report",
]
