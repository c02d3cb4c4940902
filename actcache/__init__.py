"""actcache: activation cache daemon and the torch-free wire layer."""

__version__ = "0.1.0"
