"""The system qeval runs on: its one-line errors, where it reads and writes, atomic files and locks, checkpoint
integrity, the HTTP probe, child processes (fresh or forked from a warm Python), servers that are always
stopped and the watchdog behind them, logging, progress lines, and the compute device.

It imports nothing else of pipelines/."""
