"""Measuring a build: accuracy (lm-eval), and later speed, memory and sizing."""
