"""The embedded reference model `ref-lm`: its corpus, tokenizer, training script and quality check."""
