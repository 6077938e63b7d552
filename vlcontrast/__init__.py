"""vlcontrast: CLIP-style vision-language pretraining with contrastive losses beyond InfoNCE.

Subpackages, one concern each: ``losses`` (the loss zoo), ``data`` (synthetic world, CC3M
preparation, webdataset loader), ``models`` (open_clip towers), ``train`` (DeepSpeed loop,
checkpoints, metrics), ``evaluation`` (retrieval and zero-shot). ``config`` holds the typed run
config, ``distributed`` the process-group helpers, ``cli`` the ``vlcontrast`` command.
"""

__version__ = "0.1.0"
