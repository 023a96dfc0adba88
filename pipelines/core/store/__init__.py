"""What the stages hand each other: the on-disk layout, every stage's typed result, the manifest that holds
it and how a finished stage is read back, and the gate's decision types.

It imports from pipelines/core/card and system."""
