"""Run a launcher (horovodrun, mpirun, srun, torchrun) so that a failed job ends with the failing
rank's own line and exits with its code, not with the launcher's traceback.

    python -m parle_hvd.launcher -- horovodrun --gloo -np 2 -H localhost:2 python train.py ...

Used by launch/local.sh, launch/mpirun.sh, launch/torchrun.sh and launch/slurm.sbatch. Every rank's output
passes through at once, unchanged. The launcher's own report of a failure (horovodrun's
and torchrun's Python tracebacks, horovodrun's "Process N exit with status code" lines,
mpirun's dashed banners, srun's "srun: error:" lines) is held back; when the job ends:

* the job failed and a rank printed ``error: ...``: the report goes to a log file (its
  path in one line), then the failing rank's own ``error:`` line is printed again, last,
  and the exit code is that rank's (2 bad input, 3 divergence, 4 a silent rank, or a rank
  left alone in a collective by another);
* otherwise (success, or a failure with no ``error:`` line, a crash say): the held-back
  lines are printed as they were, and the exit code is the launcher's.

SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are passed on to the launcher. Standard
library only.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

# "[1]<stderr>:..." (horovodrun), "[1,1]<stderr>:..." (mpirun --tag-output) or "[1]:..."
# (torchrun --tee 3 with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE="[${rank}]:", launch/torchrun.sh)
_RANK = re.compile(rb"^\[(?:\d+,)?(\d+)\](?:<std(?:out|err)>)?:(.*)$", re.S)
_ERROR = re.compile(rb"^error: ")
# The launcher's own lines about a failure.
_REPORT_LINE = [re.compile(p) for p in (rb"^Process \d+ exit with status code \d+\.",
                                        rb"^Terminating remaining workers after failure",
                                        rb"^srun: ",
                                        rb"^[WEI]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/")]   # torchrun's agent
_TRACEBACK = re.compile(rb"^Traceback \(most recent call last\):")
_BANNER = re.compile(rb"^-{20,}\s*$")
_EXIT_CODE = [re.compile(p) for p in (rb"Exit code:\s*(\d+)", rb"exit(?:ed)? with (?:status|exit) code (\d+)",
                                      rb"exitcode\s*:\s*(\d+)")]          # the last: torchrun's "Root Cause"
_FIRST_RANK = [re.compile(p, re.M) for p in (rb"Process name:\s*(\d+)[ \t\r]*$", rb"Process name:\s*\[\[\d+,\d+\],(\d+)\]",
                                       rb"task (\d+): Exited with exit code", rb"rank\s*:\s*(\d+) \(local_rank")]


class _Filter:
    def __init__(self):
        self.lock = threading.Lock()
        self.held: list[tuple[int, bytes]] = []     # (stream, line) of the launcher's report
        self.errors: dict[int, bytes] = {}          # rank -> its last "error:" line (as printed)
        self.last_error: bytes | None = None
        self.in_traceback = False
        self.in_banner = False

    def feed(self, stream: int, line: bytes, out) -> None:
        with self.lock:
            m = _RANK.match(line)
            if m:
                if _ERROR.match(m.group(2)):
                    self.errors[int(m.group(1))] = line
                    self.last_error = line
                out.write(line)
                out.flush()
                return
            bare = line.rstrip(b"\r\n")
            if _ERROR.match(bare):                  # an untagged rank (srun): its line counts too
                self.last_error = line
            if self.in_traceback or _TRACEBACK.match(bare):
                self.in_traceback = True            # horovodrun's own traceback runs to its end
                self.held.append((stream, line))
                return
            if self.in_banner or _BANNER.match(bare):
                if self.in_banner and _BANNER.match(bare):
                    self.in_banner = False
                elif not self.in_banner:
                    self.in_banner = True
                self.held.append((stream, line))
                return
            if any(p.match(bare) for p in _REPORT_LINE):
                self.held.append((stream, line))
                return
            out.write(line)
            out.flush()


def _pump(pipe, stream: int, filt: _Filter, out) -> None:
    for line in iter(pipe.readline, b""):
        filt.feed(stream, line, out)
    pipe.close()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m parle_hvd.launcher -- LAUNCHER [ARGS ...]", file=sys.stderr)
        return 2
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as e:
        print(f"error: cannot start {argv[0]} ({e.strerror or e})", file=sys.stderr, flush=True)
        return 2

    def forward(signum, _frame):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)

    filt = _Filter()
    outs = {1: sys.stdout.buffer, 2: sys.stderr.buffer}
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, 1, filt, outs[1]), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, 2, filt, outs[2]), daemon=True)]
    for t in pumps:
        t.start()
    rc = proc.wait()
    if rc < 0:                       # the launcher died of a signal: the shell's convention
        rc = 128 - rc
    for t in pumps:
        t.join()

    report = b"".join(line for _, line in filt.held)
    if rc != 0 and filt.last_error is not None:
        code = next((int(m.group(1)) for p in _EXIT_CODE for m in [p.search(report)] if m), rc) or rc
        first = next((int(m.group(1)) for p in _FIRST_RANK for m in [p.search(report)] if m), None)
        line = filt.errors.get(first, filt.last_error) if first is not None else filt.last_error
        where = ""
        if report:
            path = os.environ.get("PARLE_HVD_LAUNCHER_LOG") or os.path.join(
                tempfile.gettempdir(), f"parle_hvd-launcher-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
            try:
                with open(path, "ab") as f:
                    f.write(f"$ {' '.join(argv)}\n(exit {rc})\n".encode() + report)
                where = f"; the launcher's report is in {path}"
            except OSError:
                where = ""
        err = sys.stderr.buffer
        err.write(f"[launcher] {os.path.basename(argv[0])} ended the job: a rank exited with code {code}{where}\n".encode())
        err.write(line if line.endswith(b"\n") else line + b"\n")
        err.flush()
        return code
    for stream, line in filt.held:
        outs[stream].write(line)
    for o in outs.values():
        o.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
