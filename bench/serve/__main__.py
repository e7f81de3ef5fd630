"""``python -m bench.serve``: see bench/serve/cli.py and bench/README.md."""

from bench.serve.cli import main

raise SystemExit(main())
