"""Environment defaults that take effect only when set before a library loads: imported by
`train.py` ahead of torch, Lightning and pandas. A value the user exported wins."""

import os

# torch's OpenMP threads spin only briefly while they wait, then sleep. On cores that other
# processes share, a spinning thread holds a core its own team's other thread needs (GNU
# OpenMP's default spins for about 300,000 rounds); sleeping at once (OMP_WAIT_POLICY=PASSIVE)
# costs a third of the steps on quiet cores. benchmarks/threads_under_load.py measures all.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# CUDA counted through NVML, as Lightning does once imported: a launching process that
# initialised CUDA could not fork its workers (see launch.worker_start_method).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
# pyarrow (imported by pandas, which scikit-learn's data sets import) starts a jemalloc
# background thread when it loads; beside that thread the workers could not be forked.
os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
