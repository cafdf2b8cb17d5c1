"""`python -m prefixgate.backend.bench`: the engine's serving benchmark (bench/serving.py)."""
from prefixgate.backend.bench.serving import main

raise SystemExit(main())
