"""What every stage, the gate and the report stand on, in four rooms, each importing only from the rooms
below it (tests/test_architecture.py holds them to it):

- framework/: the stage registry and runner, code identity, the tracker protocol, a build's weights;
- store/: the on-disk layout, the typed results, manifests, the gate's decision types, and how their figures are
  written (formats.py: units, colours, one-line summaries, shared by the report and MLflow's tags);
- card/: the model card, its errors, the gate's policy values, the traffic it states;
- system/: errors, paths, files, integrity, the network probe, processes, logging, progress, the device.

core/ imports from eval/ and quant/ and from itself, never from the packages beside it (stages, decision,
tracking, present) or the command line. The tracker the framework logs through is a protocol defined here
(framework/tracker.py) and implemented in pipelines/tracking/.
"""
