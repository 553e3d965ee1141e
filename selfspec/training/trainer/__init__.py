"""The trainer every head shares: the loop (loop.py: batches, AdamW, accelerate, the progress bar), its checkpoints
and time budget, the losses and draft vocabularies, and the pipeline a recipe runs in (pipeline.py: train, save,
report, held-out evaluation)."""
