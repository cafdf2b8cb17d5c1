"""The `prefix_route` plugin (plugin) and its helpers: the bounded-load hash ring, the
cache-aware prefix index, the backends' load polling, and the engines' KV events (the exact
index, kv_index, fed by one ZMQ feed per upstream, kv_subscriber)."""
