"""Command-line tools beside training, `python -m ddp_template.tools.<name>`: the multi-node
lab (netlab), a multi-node SLURM on it (slurm_lab), the all-reduce probe, the scaling model
(scaling) and a sweep's report."""
