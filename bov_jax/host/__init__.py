"""What a process is, before any part of the model: who prints (process 0), JAX's
compilation cache, transparent huge pages for XLA's CPU allocations, and the optional
extras a command may need.

Imports: nothing of the package.
"""
