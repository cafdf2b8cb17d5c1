"""Offline tools for the routing and prompt plugins: the fleet simulator and its traces, the
routing-cost benchmark and the prompt benchmark. Nothing on the request path imports these."""
