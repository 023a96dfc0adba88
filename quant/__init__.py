"""Building quantized checkpoints: the precision registry, llm-compressor recipes, calibration, proofs."""
