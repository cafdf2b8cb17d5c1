"""Helpers that tests, the soak and the benchmarks share: a stand-in upstream that streams like
vLLM (standin). Nothing on the request path imports from here."""
