"""JSON for programs: every --json output is one object carrying `schema_version`, written with
allow_nan=False (NaN and Infinity are not JSON). The schema is minigraph/cli/schema.json; bump
SCHEMA_VERSION when a key changes meaning or type."""
from __future__ import annotations

import json
import math
import os

SCHEMA_VERSION = 1
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.json")


def finite(x: float) -> float:
    """x as a float, 0.0 for NaN or an infinity (no measurement): JSON has no NaN."""
    x = float(x)
    return x if math.isfinite(x) else 0.0


def emit_json(command: str, obj: dict) -> None:
    print(json.dumps({"schema_version": SCHEMA_VERSION, "command": command, **obj}, allow_nan=False))


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return json.load(f)
