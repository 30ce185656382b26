"""Command-line tools beside training: the multi-node lab (netlab), the all-reduce probe, the scaling model, and the report of a sweep."""
