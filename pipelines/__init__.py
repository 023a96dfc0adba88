"""Orchestration, in packages that are its layers; each imports only from the layers below it:

    cli, run, fanout       the command line, the run order, the Ray fan-out
    stages/, decision/     one module per stage and the engines they start; the gate
    tracking/              the MLflow store: names, the mapping of results to them, read-back
    present/               tables, charts and the report
    core/                  cards, layout, typed results, the stage framework, children, files
    (eval/, then quant/)   measuring a build; building one

tests/test_architecture.py holds the code to these layers.
"""
