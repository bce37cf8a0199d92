"""What a run keeps: paths on a disk or in a bucket (storage.py), the run directory's
names and its config of record (rundir.py), orbax checkpoints (checkpoint.py), weights
as safetensors files (safetensors.py), metrics and throughput (metrics.py), profiles
(profiler.py).

Imports: host, settings.
"""
