"""The `prefix_route` plugin (plugin) and its helpers: the bounded-load hash ring, the
cache-aware prefix index and the backends' load polling."""
