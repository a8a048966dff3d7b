"""Run several algorithms on the same budget and write a comparison report.

    python -m parle_hvd.compare --config configs/fashion_parle.yaml \\
        --algos parle,dpsgd,elastic,entropy,localsgd,diloco --np 2 [--name NAME] [key.sub=value ...]

Each algorithm runs through the real trainer (``horovodrun --gloo -np N`` on this machine,
or one process for the single-replica algorithms sgd and entropy) with the same config
and overrides, evaluating every ``eval.every`` passes. Writes ``reports/<name>/report.md``
(a table: final and best test error, wall time, passes over the data, bytes communicated,
allreduce calls) and PNG plots: test error vs wall time, vs passes, vs bytes; gamma and
rho over time; replica spread over time. Runs are kept in ``reports/<name>/runs/``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SINGLE = ("sgd", "entropy")     # one replica: run as one process


def run_algo(algo: str, config: str, np_: int, overrides: list, run_dir: Path, log) -> dict:
    py = sys.executable
    venv_bin = str(Path(py).parent)
    n = 1 if algo in SINGLE else np_
    launcher = [f"{venv_bin}/horovodrun", "--gloo", "-np", str(n), "-H", f"localhost:{n}"] if n > 1 else []
    cmd = [*launcher, py, "train.py", "--config", config, f"algo={algo}", *overrides, f"run.dir={run_dir}",
           "run.progress=lines"]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    log(f"[compare] {algo}: {' '.join(cmd)}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (run_dir.parent / f"{algo}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"[compare] {algo} failed (exit {r.returncode}); see {run_dir.parent / (algo + '.log')}\n"
                         + (r.stderr.strip().splitlines() or [""])[-1])
    return json.loads((run_dir / "summary.json").read_text())


def load_metrics(run_dir: Path) -> list:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def plots(out: Path, runs: dict) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []

    def series(ms, x, y):
        pts = [(m[x], m[y]) for m in ms if m.get(x) is not None and m.get(y) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    for x, label, fname, scale in (("train/wall_seconds", "wall time (s)", "error_vs_time.png", 1.0),
                                   ("train/passes", "passes over a replica's data", "error_vs_passes.png", 1.0),
                                   ("comm/bytes", "bytes communicated (MB)", "error_vs_bytes.png", 1e-6)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for algo, (ms, _) in runs.items():
            xs, ys = series(ms, x, "val/error")
            if xs:
                ax.plot([v * scale for v in xs], [100 * v for v in ys], marker="o", ms=3, label=algo)
        ax.set_xlabel(label)
        ax.set_ylabel("test error (%) of the reference")
        if x == "comm/bytes":
            ax.set_xscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(fname)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for algo, (ms, _) in runs.items():
        for ax, key in zip(axes, ("parle/gamma", "parle/rho")):
            xs, ys = series(ms, "train/passes", key)
            if xs:
                ax.plot(xs, ys, label=algo)
    for ax, t in zip(axes, ("gamma (local-entropy width)", "rho (elastic width)")):
        ax.set_xlabel("passes")
        ax.set_title(t)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scoping.png", dpi=110)
    plt.close(fig)
    made.append("scoping.png")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for algo, (ms, _) in runs.items():
        xs, ys = series(ms, "train/passes", "parle/replica_distance")
        if xs:
            ax.plot(xs, ys, label=f"{algo} mean")
        xs, ys = series(ms, "train/passes", "parle/replica_distance_max")
        if xs:
            ax.plot(xs, ys, ls="--", label=f"{algo} max")
    ax.set_xlabel("passes")
    ax.set_ylabel("||x_a - xbar|| at each sync")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "replica_spread.png", dpi=110)
    plt.close(fig)
    made.append("replica_spread.png")
    return made


def report(out: Path, runs: dict, cmdline: str, np_: int) -> str:
    rows = []
    for algo, (ms, s) in runs.items():
        errs = [m["val/error"] for m in ms if m.get("val/error") is not None]
        rows.append(f"| {algo} | {1 if algo in SINGLE else np_} | {100 * (1 - s['val_accuracy']):.2f} | "
                    f"{100 * min(errs):.2f} | {s['wall_seconds']:.1f} | {s['passes']:.2f} | "
                    f"{s['bytes_communicated'] / 1e6:.2f} | {s['allreduce_calls']} |")
    text = [f"# Comparison: {out.name}", "", f"Command: `{cmdline}`", "",
            "| algo | ranks | final test error (%) | best test error (%) | wall time (s) | passes over the data | "
            "MB communicated | allreduce calls |", "|---|---|---|---|---|---|---|---|", *rows, "",
            "Test error is the reference's (the replicas' mean, BN statistics recomputed; rank 0's model for "
            "sgd and entropy). Passes count each replica's data (dpsgd: the whole dataset by the global batch).", ""]
    for f in ("error_vs_time.png", "error_vs_passes.png", "error_vs_bytes.png", "scoping.png", "replica_spread.png"):
        text.append(f"![{f}]({f})")
    return "\n".join(text) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parle_hvd.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--algos", default="parle,dpsgd,elastic,entropy,localsgd,diloco")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--name", default="")
    ap.add_argument("--reports", default="reports")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    from .algorithms import ALGORITHMS
    algos = [x.strip() for x in a.algos.split(",") if x.strip()]
    bad = [x for x in algos if x not in ALGORITHMS]
    if bad:
        print(f"error: --algos: unknown {', '.join(bad)} (known: {', '.join(ALGORITHMS)})", file=sys.stderr)
        return 2
    if not Path(a.config).is_file():
        print(f"error: --config: no such file {a.config}", file=sys.stderr)
        return 2
    name = a.name or Path(a.config).stem
    out = Path(a.reports) / name
    (out / "runs").mkdir(parents=True, exist_ok=True)
    runs = {}
    for algo in algos:
        s = run_algo(algo, a.config, a.np, a.overrides, out / "runs" / algo, print)
        runs[algo] = (load_metrics(out / "runs" / algo), s)
        print(f"[compare] {algo}: final test error {100 * (1 - s['val_accuracy']):.2f} %, {s['wall_seconds']:.1f} s, "
              f"{s['bytes_communicated'] / 1e6:.1f} MB", flush=True)
    cmdline = "python -m parle_hvd.compare " + " ".join(argv if argv is not None else sys.argv[1:])
    plots(out, runs)
    (out / "report.md").write_text(report(out, runs, cmdline, a.np))
    (out / "summary.json").write_text(json.dumps({k: v[1] for k, v in runs.items()}, indent=2))
    print(f"[compare] wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
