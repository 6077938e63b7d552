"""Repository tools next to the package (not part of the wheel): benchmarks (``bench_*.py``), the
shared open_clip launcher (``openclip_launch``), the GPU check (``gpu_check``) and the device
machine's wheel folder (``device_wheels.py``, ``device_run.sh``)."""
