"""What runs inside each rank: the Lightning objects built from the config (build), the
nodes' check before the process group (node_check), communication hooks, compile,
preemption, checkpoints that cannot be torn (checkpoint_io) and the attempts they carry,
resumable loaders, generator states, memory, FLOPs, trackers and the results a run leaves."""
