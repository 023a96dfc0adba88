"""A build's quality: lm-eval runs, scored in rounds where asked, their per-document records, the emulated
low-precision arithmetic they run with, and the paired statistics and confidence sequences that judge a build
against its baseline."""
