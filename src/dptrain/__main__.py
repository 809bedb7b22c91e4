from dptrain.cli.main import main

raise SystemExit(main())
