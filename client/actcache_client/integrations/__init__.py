"""Integrations with training frameworks (optional extras): ``huggingface`` (transformers.Trainer)."""
