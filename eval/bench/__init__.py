"""The engine bench: a build's decode and prefill timed in one process (transformers), and its instruments."""
