"""The launcher of `dptrain run` and `dptrain train`: torch's elastic agent run in-process,
told about dptrain's workers, on one node or many (docs/design.md, Launches across nodes).

It imports `dptrain.runtime` and the leaf modules only: it starts processes and reports on
them, and knows nothing about training. `dptrain.cli` parses the flags and calls `launch`.

- `launch`: run torchrun's launcher with dptrain's agent; its outcome as a status and one line
- `agent`: `DptrainAgent`, torch's local agent told about our workers and the other nodes
- `round_watch`: which nodes of the agent's round of a dynamic rendezvous are gone from it
- `failures`: a failed attempt summed up in one line (the rank that failed first, the step)
- `error_files`: a worker's half-written error file replaced by a record torch reads
- `quiet`: torch's elastic loggers and C++ warnings kept quiet in the agent's process
- `rendezvous`: torchrun's rendezvous options and settings, and the network interface
- `c10d_rendezvous`: waiting for the node that serves a rendezvous, and its loss in one line
- `c10d_store`: the c10d rendezvous store, served by the first agent on its machine, joined by
  the others (a second agent on that machine too)
- `etcd_rendezvous`: the dynamic rendezvous kept in an etcd cluster (`--rdzv-backend etcd`)
- `job_end`: an elastic job's end, recorded in its run directory for a node that comes later
- `worker_env`: what the agent passes on to its workers through their environment (threads)
- `worker`: what runs in every worker process (`python -m dptrain.launcher.worker SCRIPT`)
"""
