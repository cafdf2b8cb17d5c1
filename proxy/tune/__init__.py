"""`prefixgate tune`: sweep an engine's flags on your prompts against your SLO."""
