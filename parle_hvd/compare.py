"""Run several algorithms on the same budget, over several seeds, and write a comparison
report with confidence intervals.

    python -m parle_hvd.compare --config configs/fashion_parle.yaml \\
        --algos parle,dpsgd,elastic,entropy,localsgd,diloco --np 2 --seeds 3 [--name NAME] [key.sub=value ...]

Each algorithm runs through the real trainer (``horovodrun --gloo -np N`` on this machine, or
``torchrun`` where Horovod is not installed,
or one process for the single-replica algorithms sgd and entropy) with the same config
and overrides, once per seed (``train.seed = s, s+1, ...``; initialisation, data order and
any validation split follow it), evaluating every ``eval.every`` passes. A finished run is
cached under ``reports/<name>/runs/<algo>-s<seed>-<key>`` (key: a hash of the resolved
config, the algorithm, the seed and the number of ranks), so a sweep that was stopped
resumes where it stopped and a repeated command ends in seconds.

``reports/<name>/report.md`` gives per algorithm the mean and the 95 % Student-t interval
over seeds of the final test error, of the test error at the step chosen on the
validation split (``data.val_frac``; never chosen on the test set), of the wall time to a
target test accuracy (``--target``, default the lowest mean final accuracy among the
algorithms; with ``eval.metric=loss`` or ``perplexity`` every figure is that one instead,
lower is better, and the target the highest mean final value) and of the bytes sent; and for each baseline the paired difference to Parle
over the same seeds with its 95 % interval and a verdict (better / worse / no
difference). Plots show the mean curve over seeds with a 95 % band. Every run also goes
to TensorBoard's HParams dashboard: ``tensorboard --logdir reports/<name>``.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

SINGLE = ("sgd", "entropy")     # one replica: run as one process
VOLATILE = {("run", "dir"), ("run", "name"), ("run", "progress"), ("run", "tensorboard"), ("dist", "threads")}


# --------------------------------------------------------------------------- statistics
def mean_ci(xs: list, level: float = 0.95) -> tuple:
    """(mean, half-width of the Student-t interval, n); the half-width is NaN for n < 2."""
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), 0
    m = sum(xs) / n
    if n < 2:
        return m, float("nan"), n
    from scipy.stats import t
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, float(t.ppf(0.5 + level / 2, n - 1)) * sd / math.sqrt(n), n


def paired(baseline: dict, parle: dict, level: float = 0.95) -> tuple:
    """Paired difference baseline - parle over the seeds both have: (mean, half-width, n,
    verdict for Parle). A lower error is better: 'better' when the whole interval is above 0
    (the baseline's error is higher), 'worse' when below, else 'no difference'."""
    seeds = sorted(set(baseline) & set(parle))
    m, h, n = mean_ci([baseline[s] - parle[s] for s in seeds], level)
    if n < 2 or not math.isfinite(h):
        return m, h, n, "n/a (one seed)"
    return m, h, n, "better" if m - h > 0 else "worse" if m + h < 0 else "no difference"


def _fmt(m: float, h: float, scale: float = 1.0, digits: int = 2) -> str:
    if not math.isfinite(m):
        return "-"
    return f"{scale * m:.{digits}f}" + (f" ± {scale * h:.{digits}f}" if math.isfinite(h) else "")


# --------------------------------------------------------------------------- runs
# Keys added after runs were cached: left out of the key at their defaults, so those runs stay cached.
LATER_KEYS = {("model", "target"): "", ("model", "kwargs"): {}, ("data", "target"): "", ("data", "kwargs"): {},
              ("train", "loss"): "cross_entropy", ("eval", "metric"): "accuracy"}


def algo_overrides(config: str, overrides: list, algo: str) -> list:
    """``overrides`` for ``algo``: parle.overlap and parle.balance are Parle's only (any other
    algorithm refuses them), so a comparison of overlapped Parle runs its baselines without."""
    if algo == "parle":
        return list(overrides)
    from .config import make_config
    p = make_config(config, [*overrides, "algo=parle"]).parle
    return [*overrides, *(["parle.overlap=false"] if p.overlap else []),
            *(["parle.balance=off"] if p.balance != "off" else [])]


def run_key(config: str, overrides: list, algo: str, seed: int, np_: int) -> tuple:
    """(key, resolved config): the cache key of one run."""
    from .config import make_config, to_dict
    cfg = to_dict(make_config(config, [*algo_overrides(config, overrides, algo), f"algo={algo}", f"train.seed={seed}"]))
    for sec, k in VOLATILE:
        cfg[sec].pop(k, None)
    keyed = {sec: {k: v for k, v in d.items() if LATER_KEYS.get((sec, k), object()) != v} if isinstance(d, dict)
             else d for sec, d in cfg.items()}
    n = 1 if algo in SINGLE else np_
    blob = json.dumps({"config": keyed, "np": n}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10], cfg


def run_algo(algo: str, config: str, np_: int, overrides: list, run_dir: Path, log) -> dict:
    """Run one algorithm to completion in ``run_dir`` (one seed: ``overrides`` carry it)."""
    py = sys.executable
    venv_bin = str(Path(py).parent)
    n = 1 if algo in SINGLE else np_
    if n == 1:
        launcher = []
    elif importlib.util.find_spec("horovod") is not None:
        launcher = [f"{venv_bin}/horovodrun", "--gloo", "-np", str(n), "-H", f"localhost:{n}"]
    else:                                   # a setup without Horovod (PARLE_HVD_ENGINE=torch make setup)
        launcher = [f"{venv_bin}/torchrun", "--standalone", "--nproc-per-node", str(n), "--no-python"]
    cmd = [*launcher, py, "train.py", "--config", config, f"algo={algo}", *algo_overrides(config, overrides, algo),
           f"run.dir={run_dir}",
           "run.progress=lines"]
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    log(f"[compare] {algo}: {' '.join(cmd)}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    logf = run_dir.with_name(run_dir.name + ".log")
    logf.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"[compare] {algo} failed (exit {r.returncode}); see {logf}\n"
                         + (r.stderr.strip().splitlines() or [""])[-1])
    return json.loads((run_dir / "summary.json").read_text())


class Score:
    """What the runs are ranked by, lower is better: the test error (1 - accuracy, shown in
    %) with eval.metric=accuracy, else the test loss or perplexity itself (eval.metric=loss
    or perplexity, e.g. a language model of data.target). A user's own metric has no known
    direction and is refused."""

    def __init__(self, metric: str = "accuracy"):
        self.metric = metric
        self.acc = metric == "accuracy"
        self.y, self.vy = ("val/error", "valid/error") if self.acc else (f"val/{metric}", f"valid/{metric}")
        self.scale = 100 if self.acc else 1
        self.name = "test error (%)" if self.acc else f"test {metric}"

    def final(self, s: dict) -> float:
        return 1 - s["val_accuracy"] if self.acc else s[f"test_{self.metric}"]

    def reached(self, m: dict, target: float) -> bool:
        return m["val/accuracy"] >= target if self.acc else m[self.y] <= target

    def default_target(self, runs: dict) -> float:
        """The worst mean final figure among the algorithms (each can reach it): the lowest
        accuracy, or the highest loss or perplexity."""
        if self.acc:
            return min(mean_ci([s["val_accuracy"] for _, _, s in rs])[0] for rs in runs.values())
        return max(mean_ci([self.final(s) for _, _, s in rs])[0] for rs in runs.values())

    def target_text(self, target: float) -> str:
        return (f"Target test accuracy for the time column: {100 * target:.2f} %" if self.acc
                else f"Target test {self.metric} for the time column: {target:.4g}")


def load_metrics(run_dir: Path) -> list:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]


def _curve(runs_of_algo: list, x: str, y: str) -> tuple:
    """Mean curve over seeds of ``y`` against ``x`` at each evaluation, with a 95 % band:
    (xs, means, lows, highs), the evaluations matched by their index (the same steps for
    every seed)."""
    per = [[(m[x], m[y]) for m in ms if m.get(x) is not None and m.get(y) is not None] for _, ms, _ in runs_of_algo]
    n = min((len(p) for p in per), default=0)
    xs, mu, lo, hi = [], [], [], []
    for i in range(n):
        mx, _, _ = mean_ci([p[i][0] for p in per])
        my, h, _ = mean_ci([p[i][1] for p in per])
        h = 0.0 if not math.isfinite(h) else h
        xs.append(mx), mu.append(my), lo.append(my - h), hi.append(my + h)
    return xs, mu, lo, hi


def plots(out: Path, runs: dict, sc: Score = Score()) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for x, label, fname, scale in (("train/wall_seconds", "wall time (s)", "error_vs_time.png", 1.0),
                                   ("train/passes", "passes over a replica's data", "error_vs_passes.png", 1.0),
                                   ("comm/bytes", "bytes communicated (MB)", "error_vs_bytes.png", 1e-6)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for algo, rs in runs.items():
            xs, mu, lo, hi = _curve(rs, x, sc.y)
            if xs:
                xs = [v * scale for v in xs]
                ax.plot(xs, [sc.scale * v for v in mu], marker="o", ms=3, label=f"{algo} (n={len(rs)})")
                ax.fill_between(xs, [sc.scale * v for v in lo], [sc.scale * v for v in hi], alpha=0.2)
        ax.set_xlabel(label)
        ax.set_ylabel(f"{sc.name} of the reference, mean and 95 % band")
        if x == "comm/bytes":
            ax.set_xscale("symlog", linthresh=1.0)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        made.append(fname)

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for algo, rs in runs.items():
        for ax, key in zip(axes, ("parle/gamma", "parle/rho")):
            xs, mu, _, _ = _curve(rs, "train/passes", key)
            if xs:
                ax.plot(xs, mu, label=algo)
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
    for algo, rs in runs.items():
        for key, ls, what in (("parle/replica_distance", "-", "mean"), ("parle/replica_distance_max", "--", "max")):
            xs, mu, _, _ = _curve(rs, "train/passes", key)
            if xs:
                ax.plot(xs, mu, ls=ls, label=f"{algo} {what}")
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


def run_figures(ms: list, s: dict, target: float, sc: Score = Score()) -> dict:
    """One run's figures: final test error (or loss, perplexity: ``sc``), the same at the
    evaluation with the lowest validation figure (None without a validation split), wall
    time to ``target`` (None if never reached), MB sent."""
    evs = [m for m in ms if m.get(sc.y) is not None]
    chosen = None
    if evs and all(m.get(sc.vy) is not None for m in evs):
        chosen = min(evs, key=lambda m: (m[sc.vy], m["step"]))[sc.y]
    reach = next((m["train/wall_seconds"] for m in evs if sc.reached(m, target)), None)
    return {"final": sc.final(s), "chosen": chosen, "tta": reach, "mb": s["bytes_communicated"] / 1e6,
            "wall": s["wall_seconds"], "passes": s["passes"], "calls": s["allreduce_calls"]}


def report(out: Path, runs: dict, cmdline: str, np_: int, target: float, sc: Score = Score()) -> str:
    figs = {a: {seed: run_figures(ms, s, target, sc) for seed, ms, s in rs} for a, rs in runs.items()}
    k = sc.scale
    col = lambda a, k: [f[k] for f in figs[a].values()]
    rows = []
    for algo, rs in runs.items():
        m, h, n = mean_ci(col(algo, "final"))
        cm, ch, _ = mean_ci(col(algo, "chosen"))
        tm, th, tn = mean_ci(col(algo, "tta"))
        bm, bh, _ = mean_ci(col(algo, "mb"))
        wm, wh, _ = mean_ci(col(algo, "wall"))
        rows.append(f"| {algo} | {1 if algo in SINGLE else np_} | {n} | {_fmt(m, h, k)} | {_fmt(cm, ch, k)} | "
                    f"{_fmt(tm, th, 1, 1)} ({tn}/{n}) | {_fmt(wm, wh, 1, 1)} | {rs[0][2]['passes']:.2f} | "
                    f"{_fmt(bm, bh, 1, 2)} | {rs[0][2]['allreduce_calls']} |")
    text = [f"# Comparison: {out.name}", "", f"Command: `{cmdline}`", "",
            f"Mean over seeds ± the half-width of the 95 % Student-t interval (none for one seed). "
            f"{sc.target_text(target)}; (r/n): seeds that reached it.", "",
            f"| algo | ranks | seeds | final {sc.name} | {sc.name.replace(' (%)', '')} at the best validation step"
            f"{' (%)' if sc.acc else ''} | "
            "wall time to target (s) | wall time (s) | passes | MB communicated | allreduce calls |",
            "|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    if "parle" in runs and len(runs) > 1:
        what = "error" if sc.acc else sc.metric
        text += [f"Paired over the same seeds, baseline minus Parle (positive: Parle's {what} is lower). "
                 "Verdict for Parle: better / worse when the 95 % interval excludes 0, else no difference.", "",
                 f"| baseline | final {sc.name.replace(' (%)', '')}: difference{' (points)' if sc.acc else ''} | "
                 f"verdict | at the best validation step | verdict |",
                 "|---|---|---|---|---|"]
        for algo in runs:
            if algo == "parle":
                continue
            seeds_of = lambda a, k: {sd: f[k] for sd, f in figs[a].items() if f[k] is not None}
            m, h, n, v = paired(seeds_of(algo, "final"), seeds_of("parle", "final"))
            m2, h2, n2, v2 = paired(seeds_of(algo, "chosen"), seeds_of("parle", "chosen"))
            text.append(f"| {algo} (n={n}) | {_fmt(m, h, k)} | {v} | {_fmt(m2, h2, k)} | "
                        f"{v2 if n2 else '- (no validation split)'} |")
        text.append("")
    text += ["Test error is the reference's (the replicas' mean, BN statistics recomputed; rank 0's model for "
             "sgd and entropy). Passes count each replica's data (dpsgd: the whole dataset by the global batch). "
             "Nothing is selected on the test set: the best step is chosen on the validation split.", ""]
    for f in ("error_vs_time.png", "error_vs_passes.png", "error_vs_bytes.png", "scoping.png", "replica_spread.png"):
        text.append(f"![{f}]({f})")
    return "\n".join(text) + "\n"


def write_hparams(out: Path, tag: str, cfg: dict, algo: str, seed: int, fig: dict) -> None:
    """One row in TensorBoard's HParams dashboard for this run."""
    from torch.utils.tensorboard import SummaryWriter
    hp = {"algo": algo, "seed": seed, "sync_period": cfg["parle"]["sync_period"], "lr": cfg["optim"]["lr"],
          "scoping": str(cfg["parle"]["scoping"]), "epochs": cfg["train"]["epochs"],
          "train_limit": cfg["data"]["train_limit"], "augment": cfg["data"]["augment"]}
    what = "error" if cfg["eval"]["metric"] == "accuracy" else cfg["eval"]["metric"]
    metrics = {f"hparam/test_{what}": fig["final"], "hparam/wall_seconds": fig["wall"], "hparam/mb_sent": fig["mb"]}
    if fig["chosen"] is not None:
        metrics[f"hparam/test_{what}_at_best_valid"] = fig["chosen"]
    w = SummaryWriter(log_dir=str(out / "hparams" / tag))
    w.add_hparams(hp, metrics, run_name=".")
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parle_hvd.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--algos", default="parle,dpsgd,elastic,entropy,localsgd,diloco")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=1, help="runs per algorithm, train.seed = s, s+1, ...")
    ap.add_argument("--target", type=float, default=0.0, help="test accuracy (or loss, perplexity) for the time-to-target column "
                    "(default: the worst mean final figure among the algorithms)")
    ap.add_argument("--name", default="")
    ap.add_argument("--reports", default="reports")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args(argv)          # overrides may come before or after the flags
    from .algorithms import ALGORITHMS
    from .config import ConfigError, make_config
    algos = [x.strip() for x in a.algos.split(",") if x.strip()]
    bad = [x for x in algos if x not in ALGORITHMS]
    if bad:
        print(f"error: --algos: unknown {', '.join(bad)} (known: {', '.join(ALGORITHMS)})", file=sys.stderr)
        return 2
    if not Path(a.config).is_file():
        print(f"error: --config: no such file {a.config}", file=sys.stderr)
        return 2
    if a.seeds < 1:
        print(f"error: --seeds: must be >= 1, got {a.seeds}", file=sys.stderr)
        return 2
    try:
        c0 = make_config(a.config, a.overrides)
        for algo in algos:                   # every run's config is valid before the first one starts
            make_config(a.config, [*algo_overrides(a.config, a.overrides, algo), f"algo={algo}"])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    base = c0.train.seed
    if c0.eval.metric not in ("accuracy", "loss", "perplexity"):   # a user's metric: which way is better?
        print(f"error: eval.metric: parle_hvd.compare ranks runs by accuracy, loss or perplexity, not "
              f"{c0.eval.metric} (train.py reports it: test_{c0.eval.metric} in summary.json)", file=sys.stderr)
        return 2
    sc = Score(c0.eval.metric)
    name = a.name or Path(a.config).stem
    out = Path(a.reports) / name
    (out / "runs").mkdir(parents=True, exist_ok=True)
    runs: dict = {algo: [] for algo in algos}
    where: dict = {algo: {} for algo in algos}      # algo -> seed -> run folder (runs.json)
    for seed in range(base, base + a.seeds):
        for algo in algos:
            key, cfg = run_key(a.config, a.overrides, algo, seed, a.np)
            d = out / "runs" / f"{algo}-s{seed}-{key}"
            done = d / "summary.json"
            if done.is_file():
                s = json.loads(done.read_text())
                print(f"[compare] {algo} seed {seed}: cached ({d})", flush=True)
            else:
                if d.exists():                      # a run that was stopped part-way: start it again
                    import shutil
                    shutil.rmtree(d)
                s = run_algo(algo, a.config, a.np, [*a.overrides, f"train.seed={seed}"], d, print)
                print(f"[compare] {algo} seed {seed}: final {sc.name} {sc.scale * sc.final(s):.4g}, "
                      f"{s['wall_seconds']:.1f} s, {s['bytes_communicated'] / 1e6:.1f} MB", flush=True)
            runs[algo].append((seed, load_metrics(d), s))
            where[algo][str(seed)] = d.name
    target = a.target or sc.default_target(runs)
    for algo, rs in runs.items():
        for seed, ms, s in rs:
            key, cfg = run_key(a.config, a.overrides, algo, seed, a.np)
            if not (out / "hparams" / f"{algo}-s{seed}-{key}").exists():
                write_hparams(out, f"{algo}-s{seed}-{key}", cfg, algo, seed, run_figures(ms, s, target, sc))
    cmdline = "python -m parle_hvd.compare " + " ".join(argv if argv is not None else sys.argv[1:])
    plots(out, runs, sc)
    (out / "report.md").write_text(report(out, runs, cmdline, a.np, target, sc))
    (out / "summary.json").write_text(json.dumps({k: {str(sd): s for sd, _, s in v} for k, v in runs.items()},
                                                 indent=2))
    (out / "runs.json").write_text(json.dumps(where, indent=2))
    print(f"[compare] wrote {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
