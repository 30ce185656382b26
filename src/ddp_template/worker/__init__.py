"""What runs inside each rank, below the Lightning objects that use it: the nodes' check
before the process group (node_agreement), communication hooks, compile, generator states,
memory, FLOPs, trackers and the results a run leaves. The Lightning objects themselves are
built from the config in `ddp_template.build`; resuming is `ddp_template.resume`."""
