from distllm.cli import main

raise SystemExit(main())
