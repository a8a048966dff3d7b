"""Helpers for scripts that run on each rank under tests/multirank.py."""
import json
import os
from pathlib import Path


def report(obj, rank: int) -> None:
    out = Path(os.environ["PARLE_TEST_OUT"])
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(obj))
    tmp.rename(out / f"rank{rank}.json")
