"""Transport: the connection to the node's daemon, the stream of an epoch's entries, tensors to and from entries."""

__all__: list[str] = []
