"""The daemon, in three layers, each using only the ones below it:

- ``store``: the LMDB store, its writer thread, explicit value reads, the directory lock, access;
- ``prefetch``: pushed schedules, their readers, the frames they serve, the read-ahead budget;
- ``service``: the gRPC handlers, guards, throttle, metrics, idle timeout and the server process.

``config`` holds every layer's settings.
"""

__all__: list[str] = []
