"""Orchestration: model cards, stages and their cache, MLflow tracking, the CLI."""
