"""How the worker processes of a job come to be: the elastic agent of a run started here
(agent), who started the processes and how many (world), SLURM (slurm) and packed sweeps
(packing), Lightning's cluster environments, CUDA devices as the launching process sees
them, cores per process (topology), each rank's address and interface (network), the
environment set before torch loads (process_defaults) and an Optuna study continued."""
