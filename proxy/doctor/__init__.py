"""`prefixgate doctor`: probes an OpenAI-compatible URL (cli), times one stream (trace), reads
Prometheus text (metrics), analyses prompts (prompt) and turns it all into findings (checks)."""
