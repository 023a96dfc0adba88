"""Measuring a build, in four rooms, each importing only those below it (tests/test_architecture.py holds them):

- `eval.bench` (the engine's own speed: one process, batch by batch) and `eval.load` (a server under concurrent
  users: the load generator, the objective's edge, the server's own view, capacity and cost), beside each other;
- `eval.quality`: accuracy with lm-eval, the per-document records, and the paired statistics that judge them;
- `eval.devices`: the GPU catalog, the roofline arithmetic and the memory a build needs on each device.

`eval/tasks/` holds the repository's own lm-eval tasks.
"""
