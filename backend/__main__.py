"""`python -m prefixgate.backend`: `prefixgate backend`, the bundled engine's server."""
from prefixgate.backend.cli import main

raise SystemExit(main())
