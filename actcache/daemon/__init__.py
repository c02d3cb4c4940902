"""The daemon: LMDB store, gRPC service, server lifecycle. Import the submodules you need."""

__all__: list[str] = []
