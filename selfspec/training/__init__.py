"""Self-distillation data and training, by job, each importing only its own and the jobs below it: config.py,
clock.py and throughput.py (shared), data/, trainer/, recipes/ (one module per drafter), studies/ (what scripts/ and
the device program run; nothing else in the package imports them)."""
