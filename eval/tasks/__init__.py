"""The repository's own lm-eval tasks, one folder each (a card names it as `accuracy.include_path`)."""
