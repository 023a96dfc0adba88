"""The tracking store: every MLflow name (names.py), the pure mapping of typed results to them (mapping.py),
the runs page's saved view (view.py), the store's address (store.py), the MLflow tracker (mlflow_tracker.py,
the only module that imports mlflow), and the read-back of stages and builds from the store (readback.py).

It imports pipelines/core/ (a build's description and colour: core/store/formats.py); never a stage, the gate or
presentation.
"""
