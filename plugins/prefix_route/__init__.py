"""The `prefix_route` plugin (plugin.py) and its pieces: the request's prefix keys, one scorer
per policy (chwbl with its bounded-load hash ring, cache_aware with its indexes: approximate,
or exact from the engines' KV events, kv_index fed by kv_subscriber), llama.cpp slot pinning,
and the backends' load polling."""
