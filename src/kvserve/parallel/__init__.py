"""Tensor parallelism's processes, channels and collectives.

  sharding.py   how a model splits across the ranks (the parallel layers cut their shards by it), and what cannot
  group.py      a rank's process group and its collectives (all-reduce, the logits' and attention mass's gathers)
  worker.py     a worker process: its shard of the model and of the KV pool, running the steps rank 0 sends
  workers.py    rank 0's handle on the workers: start them, run steps with them, stop them (WorkerFailure)
  channel.py    how the steps reach the workers: a shared-memory buffer, pipes, or a store's keys
  torchrun.py   ranks that torchrun started, instead of spawned ones
  watchdog.py   a step's bound, and the watch that kills the ranks of a step that runs past it

The layers that hold the shards are the model's (model/linear.py, model/embed_head.py).
"""
