"""What every stage, the gate and the report stand on: model cards, where things live on disk, the typed
results the stages hand each other, the stage registry and framework, child processes, files, progress.

It imports from eval/ and quant/ and from itself, never from the packages beside it (stages, decision,
tracking, present) or the command line. The tracker the framework logs through is a protocol defined here
(tracker.py) and implemented in pipelines/tracking/.
"""
