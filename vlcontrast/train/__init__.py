"""Training: ``train(config)`` (``loop``) and the components it is made of: the DeepSpeed engine
(``engine``), the batch stream (``batches``), one optimizer step with GradCache (``step``), the
resumable train state (``state``), the divergence guard (``guard``), DeCL's momentum towers
(``momentum``), the step logger (``steplog``), checkpoints (``checkpoint``), stop signals
(``stop``), in-training evaluation (``evaluate``), start-up checks (``preflight``), metrics sinks
(``metrics``) and the end-of-run report (``report``). A run's records are read back with
:func:`read_run_metrics` (or :func:`read_metrics`, every record as written)."""

from vlcontrast.train.loop import StopRequested, TrainingDiverged, train
from vlcontrast.train.metrics import read_metrics, read_run_metrics

__all__ = ["train", "StopRequested", "TrainingDiverged", "read_metrics", "read_run_metrics"]
