"""The model card: its schema, validated strictly (cards.py), the one-line errors a bad card gets, the gate's
policy values, the traffic a card states and its mixed-precision search.

It imports from pipelines/core/system only."""
