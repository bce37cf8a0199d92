"""Backend-specific kernels behind one switch each: what the model asks for stays the same
math on every backend; how it runs (Pallas on TPU/GPU, hand-written forms that XLA's CPU
backend runs faster) is decided here."""
