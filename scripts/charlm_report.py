"""docs/results/charlm.md from a parle_hvd.compare sweep of examples/charlm (issue 22):
validation loss and perplexity at equal passes, per algorithm, mean and 95 % Student-t
interval over seeds; paired differences to Parle; wall time to dpsgd's final validation
loss. Everything is read from the sweep's own files (summary.json, runs.json, metrics).

    python -m parle_hvd.compare --config examples/charlm/charlm.yaml --algos parle,dpsgd,localsgd,diloco \\
        --np 2 --seeds 3 --name charlm dist.threads=1
    python scripts/charlm_report.py reports/charlm docs/results/charlm.md
"""
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parle_hvd.compare import _fmt, load_metrics, mean_ci, paired  # noqa: E402


def link_table(path: Path) -> list:
    """scripts/charlm_link.py's side-by-side runs (seed 42) on loopback and at 10 Mbit."""
    if not path.is_file():
        return ["Not measured: scripts/charlm_link.py's runs (loopback and 10 Mbit) are missing."]
    res = json.loads(path.read_text())
    out = ["## Time to dpsgd's final validation loss, loopback and 10 Mbit", "",
           "`python scripts/charlm_link.py` (seed 42, one run per algorithm and link, side by side in one run; "
           "dpsgd with fp16 compression, 128 MB fusion and a 5 ms cycle as a Horovod expert would run it; the "
           "others as in the sweep). Target: that link's dpsgd run's final validation loss; time: training "
           "seconds (evaluation left out) at the first evaluation at or below it. One seed: a single "
           "measurement, no interval.", "",
           "| link | target valid loss | algo | final valid loss | training seconds | seconds to target | "
           "ratio to dpsgd | MB sent |", "|---|---|---|---|---|---|---|---|"]
    for link, r in res.items():
        for algo, x in r["runs"].items():
            t = "-" if x["to_target_seconds"] is None else f"{x['to_target_seconds']:.1f}"
            q = "-" if x["ratio_to_dpsgd"] is None else f"**{x['ratio_to_dpsgd']:.2f}**"
            out.append(f"| {link} | {r['target_valid_loss']:.4f} | {algo} | {x['final_valid_loss']:.4f} | "
                       f"{x['train_seconds']:.1f} | {t} | {q} | {x['mb']:.1f} |")
    return out


def main(src: str, dst: str, note: str = "") -> int:
    src = Path(src)
    summ = json.loads((src / "summary.json").read_text())
    where = json.loads((src / "runs.json").read_text())
    cmd = (src / "report.md").read_text().split("Command: `", 1)[1].split("`", 1)[0]
    algos = list(summ)
    fig = {a: {sd: s for sd, s in summ[a].items()} for a in algos}
    ms = {a: {sd: load_metrics(src / "runs" / where[a][sd]) for sd in summ[a]} for a in algos}
    target = mean_ci([s["valid_loss"] for s in fig["dpsgd"].values()])[0] if "dpsgd" in fig else float("nan")

    def tta(rows):
        return next((r["train/wall_seconds"] for r in rows if r.get("valid/loss") is not None
                     and r["valid/loss"] <= target), None)

    lines = ["# Character-level language model: Parle, data-parallel SGD, local SGD and DiLoCo", "",
             "examples/charlm: a nanoGPT-style transformer (2 layers, 4 heads, 64 wide, 111 k parameters, tied "
             "embeddings) predicting the next character of the Python Language Reference that CPython ships "
             "(`pydoc_data.topics`, 465 k characters, 103 distinct; 90/5/5 % contiguous train/validation/test "
             "split in windows of 64), trained through `train.py` with `model.target`, `data.target` and "
             "`train.loss`. 2 ranks on this machine's 2 cores (loopback), 3 passes over each replica's data, "
             "batch 32, SGD-Nesterov lr 0.1 (cosine) for every algorithm (DiLoCo's inner optimizer too, outer "
             "Nesterov 0.7/0.9), L = H = 25.", "",
             f"Command: `{cmd}`, then `python scripts/charlm_report.py {src} {dst}`.", "",
             "Mean over seeds ± the half-width of the 95 % Student-t interval. Loss in nats per character; "
             "perplexity = exp(loss). Equal passes: every run makes the same passes over its replica's data "
             "(dpsgd: over the whole data with the global batch, so half the gradient evaluations of the others).",
             "", "| algo | seeds | valid loss | valid perplexity | test loss | test perplexity | wall time (s) | "
             f"wall time to dpsgd's final valid loss {target:.4f} (s) | MB sent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in algos:
        v = [s["valid_loss"] for s in fig[a].values()]
        t = [s["test_loss"] for s in fig[a].values()]
        w = [s["wall_seconds"] for s in fig[a].values()]
        r = [tta(ms[a][sd]) for sd in fig[a]]
        mb = [s["bytes_communicated"] / 1e6 for s in fig[a].values()]
        (vm, vh, n), (tm, th, _), (wm, wh, _), (rm, rh, rn), (bm, bh, _) = map(mean_ci, (v, t, w, r, mb))
        vp = mean_ci([math.exp(x) for x in v])
        tp = mean_ci([math.exp(x) for x in t])
        lines.append(f"| {a} | {n} | {_fmt(vm, vh, 1, 4)} | {_fmt(vp[0], vp[1], 1, 3)} | {_fmt(tm, th, 1, 4)} | "
                     f"{_fmt(tp[0], tp[1], 1, 3)} | {_fmt(wm, wh, 1, 1)} | {_fmt(rm, rh, 1, 1)} ({rn}/{n}) | "
                     f"{_fmt(bm, bh, 1, 2)} |")
    lines += ["", "Paired over the same seeds, baseline minus Parle (positive: Parle's loss is lower); verdict "
              "better / worse when the 95 % interval excludes 0, else no difference.", "",
              "| baseline | valid loss difference | verdict | test loss difference | verdict |", "|---|---|---|---|---|"]
    verdicts = {}
    for a in algos:
        if a == "parle":
            continue
        m, h, n, vd = paired({sd: s["valid_loss"] for sd, s in fig[a].items()},
                             {sd: s["valid_loss"] for sd, s in fig["parle"].items()})
        m2, h2, _, vd2 = paired({sd: s["test_loss"] for sd, s in fig[a].items()},
                                {sd: s["test_loss"] for sd, s in fig["parle"].items()})
        verdicts[a] = vd
        lines.append(f"| {a} (n={n}) | {_fmt(m, h, 1, 4)} | {vd} | {_fmt(m2, h2, 1, 4)} | {vd2} |")
    better = [a for a, v in verdicts.items() if v == "better"]
    worse = [a for a, v in verdicts.items() if v == "worse"]
    same = [a for a, v in verdicts.items() if v == "no difference"]
    lines += ["", "## Verdict", "",
              "On validation loss at equal passes, Parle is "
              + "; ".join(x for x in (f"better than {', '.join(better)}" if better else "",
                                      f"worse than {', '.join(worse)}" if worse else "",
                                      f"no different from {', '.join(same)}" if same else "") if x)
              + " (3 seeds, 95 % paired intervals). This is one small model on one small corpus on a CPU, "
                "a few minutes per run: it says nothing about the paper's large-network regime.", "",
              "The wall-time column of the table above is the loopback sweep's; the links are compared "
              "below.", "", *link_table(src.parent / "charlm_link" / "links.json")]
    if note:
        lines += ["", note]
    Path(dst).write_text("\n".join(lines) + "\n")
    # the figures for docs/CLAIMS.md's row (scripts/write_claims.py reads them)
    vm = {a: mean_ci([s["valid_loss"] for s in fig[a].values()]) for a in algos}
    Path(dst).with_suffix(".json").write_text(json.dumps({
        "command": cmd, "valid_loss": {a: {sd: s["valid_loss"] for sd, s in fig[a].items()} for a in algos},
        "test_loss": {a: {sd: s["test_loss"] for sd, s in fig[a].items()} for a in algos},
        "mean_ci": {a: list(v[:2]) + [v[2]] for a, v in vm.items()}, "verdicts": verdicts}, indent=2) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
