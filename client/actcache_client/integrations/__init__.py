"""Integrations with training frameworks, each an optional extra: ``huggingface`` (``transformers.Trainer``,
``actcache[huggingface]``) and ``lightning`` (a Lightning callback, ``actcache[lightning]``)."""

__all__: list[str] = []
