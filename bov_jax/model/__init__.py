"""The GPT of the paper with every value mode (gpt.py) and what a value mode makes of a
target layer's value (combine.py), its initialisation (initialize.py), the decoding
cache (kvcache.py), the weight matmul's CPU form (matmul.py), the chunked
cross-entropy (loss.py), and its parameters placed on a mesh or read from a
checkpoint or an exported folder (params.py).

Imports: host, kernels, parallel, settings, store.
"""
