"""The loss studies: cells of short training runs, run in stages, and their reports.

Two layouts share one engine. The grid (study v1) trains loss x global batch size x seed at a
fixed learning-rate rule. The staged study (study v2, a config with ``datasets:``) prepares its
datasets and starting checkpoints, sweeps each loss setting's learning rate and options on the
validation split, commits the choice, and trains the chosen settings at the final seeds on the
test split.

``vlcontrast study --config configs/study/<name>.yaml [key=value ...]`` reads a
:class:`StudyConfig`, makes what the cells need when it is missing (datasets, starting
checkpoints), runs every unfinished cell as its own training process, stores one small result
file per finished cell, and writes the report (CSV, tables with confidence intervals and paired
comparisons, plots). See ``docs/loss-study.md``, ``docs/loss-study-v2.md`` and
``docs/study-gpu.md``.

Modules: :mod:`.engine` (the stages, the one cell loop, the single-cell entry point),
:mod:`.config` (the study's typed config), :mod:`.paths` (where its relative paths point),
:mod:`.design` (the staged layout's cells: datasets, arms, sweeps, finals) and :mod:`.grid` (the
grid layout's cells, study v1), :mod:`.cells` (running a training, its result file),
:mod:`.warm` (cells forked from a server that imported the trainer once), :mod:`.v2` (starts,
the tuning choice, reruns, the plan), :mod:`.splits` (the clip-art corpus's train/val/test
split), :mod:`.budget` (machine-time estimates, CPU model and measured GPU step times),
:mod:`.stats` (t intervals, paired t, Holm-Bonferroni, detectable difference), :mod:`.report`
and :mod:`.report_v2` (the two layouts' reports), :mod:`.findings` and :mod:`.caveats`
(generated doc blocks).
"""

from .cells import ensure_pretrained, read_result, result_path, summarise_run
from .config import StudyConfig, StudyData, StudyGrid, StudyPretrain, load_study_config
from .grid import (Cell, cell_command, cell_fingerprint, cell_learning_rate, cell_overrides,
                   data_overrides, grid_cells, pretrain_command, pretrain_dir)
from .report import collect_rows, comparison_family, markdown_tables, write_csv, write_report
from .engine import (StudyResult, is_finished, next_round, prepare, run_cells, run_one,
                     run_study)
from .stats import (holm_adjust, mean_interval, minimum_detectable_difference, paired_comparison,
                    t_quantile, t_two_sided_p)

__all__ = [
    "Cell", "StudyConfig", "StudyPretrain", "ensure_pretrained", "pretrain_command", "pretrain_dir", "StudyData", "StudyGrid", "StudyResult", "cell_command",
    "cell_fingerprint", "cell_learning_rate", "cell_overrides", "collect_rows", "data_overrides",
    "comparison_family", "grid_cells", "holm_adjust", "is_finished", "load_study_config", "markdown_tables", "mean_interval",
    "minimum_detectable_difference", "next_round", "paired_comparison", "prepare", "read_result",
    "result_path", "run_cells", "run_one", "run_study", "summarise_run", "t_quantile", "t_two_sided_p", "write_csv",
    "write_report",
]
