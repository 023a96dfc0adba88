"""ref-lm's tasks on its held-out chapters: their YAMLs, items (made by make_tasks.py) and scoring helpers."""
