from prefixgate.kernels.bench.micro import main

raise SystemExit(main())
