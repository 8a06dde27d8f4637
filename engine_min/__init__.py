"""engine_min: a minimal paged-attention engine (engine -> scheduler -> block manager; model
runner -> model -> kernels).

Importing the package has no side effects; the entry points set the OpenMP wait policy
before torch loads (``engine_min.omp.set_omp_wait_policy``).
"""
