"""Rank 0's outputs: TensorBoard scalars, metrics.jsonl, console lines or a tqdm bar."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


class RunLogger:
    """Writes only on rank 0; on other ranks every method is a no-op."""

    def __init__(self, run_dir: Path, *, enabled: bool, tensorboard: bool, progress: str,
                 total: int, start_step: int = 0):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.tb = None
        self.bar = None
        self._jsonl = None
        self._last_line = 0.0
        if not enabled:
            return
        if start_step:
            self._truncate_jsonl(start_step)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            # purge_step drops events a crashed run wrote after the checkpoint we resume from
            self.tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=start_step + 1 if start_step else None)
        use_bar = progress == "bar" or (progress == "auto" and sys.stderr.isatty())
        if use_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start_step, unit="outer step", dynamic_ncols=True)

    def _truncate_jsonl(self, step: int) -> None:
        p = self.run_dir / "metrics.jsonl"
        if not p.exists():
            return
        keep = []
        for line in p.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                pass   # a line torn by a crash
        tmp = p.with_suffix(".tmp")
        tmp.write_text("".join(l + "\n" for l in keep))
        tmp.replace(p)

    def scalars(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if v is not None and math.isfinite(float(v)) else None) for k, v in values.items()}
        self._jsonl.write(json.dumps({"step": step, "time": round(time.time(), 3), **clean}) + "\n")
        if self.tb:
            for k, v in clean.items():
                if v is not None:
                    self.tb.add_scalar(k, v, step)

    def ensure_row(self, step: int, values: dict) -> None:
        """Write outer step ``step``'s training row unless metrics.jsonl already has it (an
        elastic reset: the rank 0 that was lost may have died between the step and its row)."""
        if not self.enabled:
            return
        key = next(iter(values), None)
        for line in (self.run_dir / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step") == step and key in row:
                return
        self.scalars(step, values)

    def text(self, tag: str, text: str) -> None:
        if self.enabled and self.tb:
            self.tb.add_text(tag, "```\n" + text + "\n```")

    def info(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def progress(self, step: int, msg: str, force: bool = False) -> None:
        if not self.enabled:
            return
        if self.bar:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(msg, refresh=False)
        elif force or time.monotonic() - self._last_line >= 10.0:
            self._last_line = time.monotonic()
            print(f"step {step}: {msg}", flush=True)

    def flush(self) -> None:
        if self.tb:
            self.tb.flush()
        if self._jsonl:
            self._jsonl.flush()

    def close(self) -> None:
        """Each part closed even if another fails (a full disk makes TensorBoard's flush raise
        on every call); the first failure is raised after."""
        try:
            if self.bar:
                self.bar.close()
            if self.tb:
                try:
                    self.tb.flush()
                finally:
                    self.tb.close()
        finally:
            if self._jsonl:
                self._jsonl.close()
