"""The stage framework: the stage registry, the runner (cache key, lock, partial-then-swap, failure), code
identity, the tracker protocol a stage logs through, a build's weights, and what a card asks of this machine.

It imports from the other rooms of pipelines/core."""
