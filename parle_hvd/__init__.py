"""parle_hvd: Parle (Chaudhari et al., arXiv 1707.00424) on Horovod/MPI."""

__version__ = "0.1.0"
