"""`python -m pipelines` is the `qeval` command."""

from pipelines.cli import app

app(prog_name="qeval")
