"""How the worker processes of a job come to be: the elastic agent of a run started here
(agent), the external starters and their table (starters), how many processes on how many
nodes (world), SLURM (slurm) and packed sweeps (packing), Lightning's cluster environments
for starters it does not rank (environments), CUDA devices as the launching process sees
them, cores per process (topology), each rank's address and interface (network) and the
environment set before torch loads (process_defaults)."""
