"""python -m minigraph ...: the `minigraph` command."""
from minigraph.cli import main

raise SystemExit(main())
