"""Benchmarks: timing claims live here (docs/performance.md holds their numbers), never in
the library or the tests.

  python -m benchmarks.train   the compiled train step: tokens/s, MFU, a profile
  python -m benchmarks.decode  decoding throughput and cache bytes per context length
  python -m benchmarks.dots    the train step's matmuls, each timed alone
"""
