"""`python -m bov_jax.data download ...`: the corpus command under its older name."""

import sys

from bov_jax import cli
from bov_jax import corpus

cli.run(lambda argv: sys.exit(corpus.main(argv)))
