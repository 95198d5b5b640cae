from specdec.native import main

raise SystemExit(main())
