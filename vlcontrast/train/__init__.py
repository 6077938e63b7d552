"""Training: DeepSpeed engine (``engine``), the loop (``loop``), atomic checkpoints
(``checkpoint``), metrics sinks (``metrics``) and the end-of-run report (``report``)."""

from vlcontrast.train.loop import StopRequested, TrainingDiverged, train

__all__ = ["train", "StopRequested", "TrainingDiverged"]
