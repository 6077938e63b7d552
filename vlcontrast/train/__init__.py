"""Training: ``train(config)`` (``loop``) and the components it is made of: the DeepSpeed engine
(``engine``), the batch stream (``batches``), one optimizer step with GradCache (``step``), the
resumable train state (``state``), the divergence guard (``guard``), DeCL's momentum towers
(``momentum``), the step logger (``steplog``), checkpoints (``checkpoint``), stop signals
(``stop``), in-training evaluation (``evaluate``), start-up checks (``preflight``), metrics sinks
(``metrics``) and the end-of-run report (``report``)."""

from vlcontrast.train.loop import StopRequested, TrainingDiverged, train

__all__ = ["train", "StopRequested", "TrainingDiverged"]
