"""Self-distillation data and training."""
