"""Integrations with training frameworks (optional extras): Hugging Face ``Trainer``, Lightning."""
