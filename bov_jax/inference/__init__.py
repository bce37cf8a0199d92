"""Text generation over the decoding cache (generate.py) and the choice of the next
token (sampling.py).

Imports: kernels, model, parallel.
"""
