"""Building quantized checkpoints: the precision registry and, per precision, its llm-compressor recipe."""
