"""Integrations with training frameworks (optional extras): Hugging Face ``Trainer``, Lightning."""

__all__: list[str] = []  # the integrations are imported by their module names
