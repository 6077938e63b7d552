"""The GPU check: every GPU concern of vlcontrast in one table, in groups of at most 8 minutes.

    python -m bench.gpu_check [--reduced] [--out DIR] [--only GROUP,...]      (make gpu-check)

Groups (``--only``, comma list; docs/training.md "GPU check" gives what each runs, its estimated
time on one H100 and the order to run them in): ``syncs``, ``losses``, ``resume``, ``matrix``,
``step``, ``throughput``, ``memory``.

The orchestrating process never imports DeepSpeed and never trains: every training (and every
memory probe) runs in its own subprocess (``python -m bench.gpu_check.worker JOB.json``), because
DeepSpeed's ZeRO engines stay reachable through their hooks after a run (``engine.destroy()``
frees ZeRO-1/2 but not ZeRO-3), so runs in one process would add up their GPU memory. Each run's
checkpoints are deleted once its checks are done; the disk budget is printed up front and the check
refuses to start when the output folder's disk is too small.

Without CUDA (or with ``--reduced``) it runs a reduced variant on the CPU in a few minutes: micro
towers at 32 px, 2 steps, a diagonal of the precision x ZeRO matrix; ``--reduced`` sets
``DS_ACCELERATOR=cpu`` before anything can import DeepSpeed, also on a CUDA host.
``tests/bench/test_gpu_check.py`` runs it inside ``make test``.
"""

GROUPS = ("syncs", "losses", "resume", "matrix-rn", "matrix-vit", "step", "throughput",
          "memory")
"""In the order they run, cheapest signal first. The precision x ZeRO matrix is one group per
tower family so that each fits one device call (``--only matrix`` names both)."""

ALIASES = {"matrix": ("matrix-rn", "matrix-vit")}
