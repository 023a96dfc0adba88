"""The gate: what it reads of the stages (inputs.py), what a build costs under the card's traffic (pricing.py),
its policy as pure rules (policy.py), and the decision recorded in gate.json, MLflow and the Model Registry
(gate.py).

It imports pipelines/core/ (results, verdict types), pipelines/tracking/ (the read-back of stages from the
store) and eval/; never a stage module, nor presentation: the caller hands the gate what writes the ship card,
and the report reads the decision.
"""
