"""Write docs/RESULTS.md from the `name: value` files scripts/results.sh leaves in docs/results/."""
import re
import sys
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])


def load(name):
    f = src / f"{name}.txt"
    if not f.exists():
        return {}, "", ""
    lines = f.read_text().splitlines()
    cmd = lines[0][3:].split(": ", 1)[-1] if lines and lines[0].startswith("== ") else ""
    vals = {}
    for l in lines[1:]:
        m = re.match(r"^([a-z0-9_]+): (.*)$", l)
        if m:
            vals[m.group(1)] = m.group(2)
    return vals, cmd, vals.get("elapsed_seconds", "?")


def f(v, d="-"):
    return v if v is not None else d


out = ["# Results", "",
       "**The paper's claims (speed, generalization, split data, flat minima, heterogeneous systems) are tested "
       "in [CLAIMS.md](CLAIMS.md)**, over several seeds with 95 % intervals, selection on a validation split, and "
       "dpsgd tuned (fp16, fusion, cycle time); `make claims` regenerates it. Where the two pages differ (time to "
       "accuracy, the comparison report, split data), CLAIMS.md is the one to read. Its RQ5 section (the "
       "overlapped sync and replicas of unequal speed, issue 13) is repeated at the end of this page.", "",
       "> **Read with care (2026-12-02).** Every figure below but the last section is one seed, measured "
       "before the correctness fixes of issue 11: Elastic-SGD then used momentum 0.9 and scoped on a clock about "
       "25x faster than Parle's, dpsgd's evaluated weights were rounded by an average, and the \"best test "
       "error\" column picked its step on the test set. They are kept as they were measured.", "",
       "Measured on this project's machine: 2 CPU cores, no GPU, Python 3.11, torch 2.13.0 (CPU), Horovod "
       "0.28.1 (Gloo and MPI controllers). Every figure below was produced by the command shown beside it; "
       "`make results` (= `scripts/results.sh`) reruns them all and rewrites this page. Raw `name: value` output: "
       "`docs/results/*.txt`. Ratios are measured within one run, never against a stored baseline.", ""]

ov, cm, pl, tt, sp = (load(n)[0] for n in ("overhead", "communication", "pipeline", "time_to_accuracy", "split_data"))


def met(ok):
    return "met" if ok else "**missed**"


def num(d, k):
    try:
        return float(d[k])
    except (KeyError, ValueError):
        return None


rows = [("Parle replica / plain SGD samples per second", ">= 0.95", ov.get("overhead_ratio"),
         met(ov.get("overhead_target_met") == "1")),
        ("bytes per sample, parle / dpsgd", "<= 1/L = 0.04", cm.get("bytes_per_sample_ratio"),
         met(cm.get("bytes_per_sample_target_met") == "1")),
        ("input pipeline speedup", ">= 5", pl.get("pipeline_speedup"), met(pl.get("pipeline_target_met") == "1")),
        ("time to dpsgd's accuracy, parle / dpsgd, loopback", "<= 0.5", tt.get("tta_ratio_loopback"),
         met((num(tt, "tta_ratio_loopback") or 9) <= 0.5)),
        ("time to dpsgd's accuracy, parle / dpsgd, 100 Mbit between two hosts", "<= 0.25",
         tt.get("tta_ratio_throttled"), met((num(tt, "tta_ratio_throttled") or 9) <= 0.25))]
out += ["## Targets at a glance", "", "| figure | target | measured | |", "|---|---|---|---|"]
out += [f"| {a} | {b} | {f(c)} | {d} |" for a, b, c, d in rows]
out += ["", "What limits the missed ones:", "",
        "- **Bytes per sample.** Parle's one allreduce per outer step carries the BatchNorm running statistics "
        "(PARLE.md: buffers are averaged with the weights), rank 0's schedule and one slot row per replica, "
        f"{f(cm.get('parle_sync_bytes_over_weight_bytes'))}x the weight bytes, plus one extra sync that forms the first "
        "reference; dpsgd sends gradients only. The excess over 1/L is that, not a second collective.",
        "- **Time to accuracy.** On this machine both ranks share 2 CPU cores and the loopback network is almost "
        "free, so dpsgd pays little for its allreduce every step, while each Parle replica processes the whole "
        "dataset per pass (dpsgd's ranks split it): Parle needs about the same wall time to reach dpsgd's final "
        "accuracy. At 100 Mbit between two hosts dpsgd's 530 KB per step costs ~40 ms and Parle comes out ahead "
        "(ratio above), but not by 4x: LeNet is small, so compute, not the link, still dominates. The paper's "
        "2-4x was computed for larger networks, not measured. The runs use 8 passes (the `make results` budget "
        "that fits one session); `PASSES=20 make results` reruns them with the presets' 20.",
        "- **Split data.** With 8 passes over a third of the data each Parle replica makes few outer steps, so "
        "scoping has barely begun (gamma and rho near their starting values) when the run ends; Parle then does "
        "not beat SGD on the same third. The paper's runs are far longer (125+ passes).", ""]

v, cmd, t = load("overhead")
out += ["## Compute overhead of a Parle replica", "", f"`{cmd}` ({t} s)", "",
        "| plain SGD samples/s | Parle replica samples/s | ratio | target |", "|---|---|---|---|",
        f"| {f(v.get('overhead_sgd_samples_per_sec'))} | {f(v.get('overhead_parle_samples_per_sec'))} | "
        f"**{f(v.get('overhead_ratio'))}** | >= 0.95 ({'met' if v.get('overhead_target_met') == '1' else 'missed'}) |", ""]

v, cmd, t = load("communication")
out += ["## Communication per training sample (2 ranks, LeNet, Fashion-MNIST, one pass)", "", f"`{cmd}` ({t} s)", "",
        "| algo | bytes / sample | allreduce calls / sample | allreduce calls |", "|---|---|---|---|"]
for a in ("parle", "localsgd", "diloco", "elastic", "dpsgd"):
    out.append(f"| {a} | {f(v.get(f'comm_{a}_bytes_per_sample'))} | {f(v.get(f'comm_{a}_allreduce_calls_per_sample'))} | "
               f"{f(v.get(f'comm_{a}_allreduce_calls'))} |")
out += ["", f"bytes_per_sample_ratio (parle / dpsgd) = **{f(v.get('bytes_per_sample_ratio'))}**, target <= 1/L = "
        f"{f(v.get('bytes_per_sample_target'))} ({'met' if v.get('bytes_per_sample_target_met') == '1' else 'missed'}). "
        f"Parle's sync carries {f(v.get('parle_sync_bytes_over_weight_bytes'))}x the weight bytes (BatchNorm statistics, "
        f"the schedule and the per-replica slots ride along; dpsgd never sends BatchNorm statistics while training). "
        f"calls_per_sample_ratio = {f(v.get('calls_per_sample_ratio'))}.", ""]

v, cmd, t = load("sync_cost")
out += ["## Cost of one sync (2 ranks, mpirun; Horovod's MPI controller and torch.distributed's Gloo)", "",
        f"`{cmd}` ({t} s)", "",
        "| model | MB | tensors | fused, Horovod (ms) | fused, torch.distributed (ms) | one hvd.allreduce per tensor (ms) | "
        "mpi4py Allreduce (ms) | torch / Horovod | per-tensor / fused | mpi4py / fused |",
        "|---|---|---|---|---|---|---|---|---|---|"]
for m in ("lenet", "allcnn", "resnet18"):
    g = lambda k: f(v.get(f"sync_{m}_{k}"))
    out.append(f"| {m} | {g('mbytes')} | {g('tensors')} | {g('fused_ms')} | {g('torch_fused_ms')} | {g('per_tensor_ms')} | "
               f"{g('mpi4py_ms')} | {g('torch_over_horovod')} | {g('per_tensor_over_fused')} | {g('mpi4py_over_fused')} |")
out += ["", "Each figure is the median of 5 rounds in which the four ways alternate in the same two processes. "
        "\"fused\" is parle_hvd's sync exactly (comm.allreduce_mean_: pack into one flat buffer, one allreduce, "
        "unpack), through either engine (dist.engine). Fusing every tensor into one call is what matters: one "
        "hvd.allreduce per tensor costs several times more. A bare mpi4py Allreduce on one numpy buffer skips the "
        "packing and Horovod's background thread (a negotiation cycle and a copy into its fusion buffer); "
        "torch.distributed's Gloo also skips the background thread but goes over TCP loopback, not MPI's shared "
        "memory.", ""]

if (src / "engines_run.txt").exists():
    v, cmd, t = load("engines_run")
    g = lambda k: v.get(f"engines_run_{k}", "n/a")
    out += ["## `make run` through either engine (the default preset: Parle, 2 replicas, 20 passes)", "",
            f"`{cmd}` ({t} s)", "",
            "| engine | val_accuracy (test set) | training seconds | allreduces | bytes |", "|---|---|---|---|---|"]
    for tag in ("horovod", "torch"):
        out.append(f"| {g(tag + '_engine')} | {g(tag + '_val_accuracy')} | {g(tag + '_wall_seconds')} | "
                   f"{g(tag + '_allreduce_calls')} | {g(tag + '_bytes')} |")
    out += ["", f"val_accuracy is the test set's, as in make run. Difference {g('val_accuracy_difference_points')} "
            f"points (target: within 0.3, "
            f"{'met' if g('within_target') == '1' else 'missed'}); the same output files: "
            f"{'yes' if g('same_outputs') == '1' else 'no'}; final.pt bit-identical: "
            f"{'yes' if g('final_bit_identical') == '1' else 'no'}. The bytes differ only by the length of run.dir "
            "inside the config rank 0 broadcasts at the start. The two runs shared the machine's 2 cores "
            "(they ran at the same time), so their seconds are not a speed comparison; bench.dpsgd_engines and "
            "bench.sync_cost are.", ""]

if (src / "dpsgd_engines.txt").exists():
    v, cmd, t = load("dpsgd_engines")
    out += ["## Data-parallel SGD through either engine (2 ranks, LeNet, Fashion-MNIST)", "", f"`{cmd}` ({t} s)", "",
            "| gradients on the wire | Horovod DistributedOptimizer, samples/s (range) | "
            "DistributedDataParallel, samples/s (range) | DDP / Horovod |", "|---|---|---|---|"]
    for tag in ("fp16", "fp32"):
        g = lambda k: v.get(f"dpsgd_{tag}_{k}", "n/a")
        out.append(f"| {tag} | {f(g('horovod_samples_per_sec'))} ({g('horovod_samples_per_sec_range')}) | "
                   f"{f(g('torch_samples_per_sec'))} ({g('torch_samples_per_sec_range')}) | "
                   f"**{f(g('ddp_over_horovod'))}** |")
    out += ["", f"Medians of {v.get('dpsgd_runs_per_setting')} runs per setting, alternating. Horovod is tuned as for "
            "the claims (fp16 compression, HOROVOD_FUSION_THRESHOLD 128 MB, HOROVOD_CYCLE_TIME 5 ms; horovodrun "
            "--gloo); DDP runs with its defaults (25 MB buckets, allreduced during the backward pass; fp16 by a "
            "comm hook) under torchrun. samples/s counts training time only (evaluations excluded).", ""]

v, cmd, t = load("pipeline")
out += ["## Input pipeline (augmented CIFAR-shaped batches of 128, one core)", "", f"`{cmd}` ({t} s)", "",
        "| ours (batches/s) | per-image DataLoader + transforms (batches/s) | speedup | target |", "|---|---|---|---|",
        f"| {f(v.get('pipeline_ours_batches_per_sec'))} | {f(v.get('pipeline_dataloader_batches_per_sec'))} | "
        f"**{f(v.get('pipeline_speedup'))}** | >= 5 ({'met' if v.get('pipeline_target_met') == '1' else 'missed'}) |", "",
        "The per-image side is torchvision's recipe (RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, "
        "Normalize through a DataLoader) written with PIL and numpy, because torchvision cannot be installed beside "
        "the CPU torch build here (requirements.txt).", ""]

v, cmd, t = load("time_to_accuracy")
out += ["## Time to accuracy (2 ranks, Fashion-MNIST, LeNet)", "", f"`{cmd}` ({t} s; the loopback runs are the "
        "comparison report's below)", "",
        "Wall seconds of training until the reference first reaches dpsgd's final test accuracy.", "",
        "| link | target accuracy | dpsgd (s) | parle (s) | localsgd (s) | diloco (s) | parle / dpsgd | target |",
        "|---|---|---|---|---|---|---|---|"]
for tag, tgt in (("loopback", "<= 0.5"), ("throttled", "<= 0.25")):
    g = lambda k: f(v.get(f"tta_{tag}_{k}"))
    ratio = v.get(f"tta_ratio_{tag}")
    link = tag if tag == "loopback" else f"two hosts, {f(v.get('tta_throttled_rate'))}"
    out.append(f"| {link} | {g('target_accuracy')} | {g('dpsgd_seconds')} | {g('parle_seconds')} | "
               f"{g('localsgd_seconds')} | {g('diloco_seconds')} | **{f(ratio)}** | {tgt} |")
out += ["", "Final accuracies and total wall seconds per run:", "", "| link | algo | final accuracy | wall s |", "|---|---|---|---|"]
for tag in ("loopback", "throttled"):
    for a in ("dpsgd", "parle", "localsgd", "diloco"):
        if f"tta_{tag}_{a}_final_accuracy" in v:
            out.append(f"| {tag} | {a} | {v[f'tta_{tag}_{a}_final_accuracy']} | {v[f'tta_{tag}_{a}_wall_seconds']} |")
out.append("")

if (src / "report.md").exists():
    rep = (src / "report.md").read_text().splitlines()
    v, cmd, t = load("compare")
    out += ["## Comparison report (same budget, 2 ranks; sgd and entropy one process)", "", f"`{cmd}` ({t} s)", ""]
    out += [l.replace("](", "](results/") if l.startswith("![") else l for l in rep[4:]]
    out += ["", "For context, the paper's closest row (LeNet on MNIST, not Fashion-MNIST, so not comparable one to "
            "one; PARLE.md): SGD 0.50 %, Entropy-SGD 0.49 %, Elastic-SGD 0.48 % (n=6), Parle 0.44 % (n=6).", ""]

v, cmd, t = load("split_data")
paper = {"parle_n3_third": "-", "sgd_third": "-", "parle_n2_half": "-", "sgd_half": "-", "sgd_full": "-"}
out += ["## Split data (the paper's RQ3), Fashion-MNIST, LeNet", "", f"`{cmd}` ({t} s)", "",
        "| run | ranks | each replica's data | test error (%) | wall s |", "|---|---|---|---|---|"]
for name, frac in (("parle_n3_third", "1/3"), ("sgd_third", "1/3"), ("parle_n2_half", "1/2"), ("sgd_half", "1/2"),
                   ("sgd_full", "all")):
    out.append(f"| {name} | {f(v.get(f'split_{name}_ranks'))} | {frac} | {f(v.get(f'split_{name}_test_error_pct'))} | "
               f"{f(v.get(f'split_{name}_wall_seconds'))} |")
out += ["", "The paper's split-data rows (All-CNN-C on CIFAR-10, PARLE.md): n=3 with 1/2 each: Parle 5.89 %, "
        "Elastic-SGD 6.51 %, SGD on all the data 6.15 %; n=6 with 1/4 each: Parle 6.08 %, Elastic-SGD 6.8 %.", ""]

rq5 = src / "claims" / "rq5.md"         # written by scripts/write_claims.py from scripts/rq5_*.py's reports
if rq5.is_file():
    out += [l.replace("## RQ5 heterogeneous systems: ", "## RQ5 (issue 13): ", 1) for l in rq5.read_text().splitlines()]
    out += ["The same section, with its verdict, is RQ5 in [CLAIMS.md](CLAIMS.md).", ""]

ds = src / "data_scale.md"              # written by python -m bench.data_scale --md
if ds.is_file():
    out += ds.read_text().splitlines()

dst.write_text("\n".join(out) + "\n")
