"""The `minigraph` command, one module per job: `main` (the parser and the error handling),
`args` (flag types and checks), `session` (devices, model and runner from the flags), `memory`
(the up-front memory estimate), `output` (JSON for programs), and one module per subcommand."""
from .main import main

__all__ = ["main"]
