"""The model card: its schema, validated strictly (cards.py), the one-line errors a bad card gets, the gate's
policy values and the traffic a card states.

It imports from pipelines/core/system only."""
