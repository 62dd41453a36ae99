"""python -m minigraph.cli ..."""
from .main import main

raise SystemExit(main())
