"""`python -m spmd` is `python -m spmd.train`."""

import sys

from spmd.parallel import huge_pages

huge_pages.restart_early(sys.argv[1:])  # before spmd.train imports JAX (see spmd/train.py)

from spmd.train import command  # noqa: E402

command()
