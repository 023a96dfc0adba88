"""Measuring a build: accuracy (lm-eval), engine and server speed, memory, sizing, and paired statistics."""
