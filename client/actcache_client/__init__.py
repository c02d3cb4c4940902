"""actcache_client: serve a network's frozen prefix from the actcache daemon."""
