"""`prefixgate bench`: the load generator (cli), its client, prompts, statistics and archive,
the seed scenario, the gateway-overhead comparison against nginx, and the soak."""
