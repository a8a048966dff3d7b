"""Nothing lost: exact resume after kill -9 at several moments, SIGTERM/SIGINT stops with a
checkpoint, divergence stops naming rank and step, a silent rank is named within the
timeout, and bad input ends with one line and exit 2 without damaging anything."""
import contextlib
import hashlib
import re
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from multirank import ROOT, RankJob, kill_tree, rank_process, run_ranks, run_sweep
from parle_hvd import checkpoint

FASHION = Path("/usr/share/datasets/fashion-mnist")
pytestmark = pytest.mark.skipif(not FASHION.is_dir(), reason="make setup installs dataset-fashion-mnist")
TRAIN = ROOT / "tests/ranks/train_rank.py"
CFG = ["--config", "configs/fashion_parle.yaml"]
SMALL = ["data.train_limit=2560", "data.test_limit=1000", "parle.sync_period=5", "train.batch_size=64",
         "run.progress=lines", "eval.bn_batches=5", "eval.every=1", "run.log_every=1"]


def _final(d):
    return torch.load(Path(d) / "final.pt")


def _wait_for(cond, job, timeout=120, what=""):
    t0 = time.monotonic()
    while not cond():
        assert job.proc.poll() is None, f"job ended before {what}:\n{job.output}"
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}:\n{job.output}"
        time.sleep(0.01)


def _metrics_lines(d):
    f = Path(d) / "metrics.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


# ------------------------------------------------------------------------ kill -9 and resume
COMMON = [*CFG, *SMALL, "train.epochs=3", "run.ckpt_every=3"]       # 24 outer steps, checkpoints every 3
# (not bytes_communicated: it counts the broadcast config, whose run.dir differs in length)
SUMMARY_FIGURES = ("val_accuracy", "val_loss", "evaluations", "outer_steps", "allreduce_calls", "allreduce_bytes",
                   "broadcast_calls", "samples_seen", "final_replica_distance", "final_replica_distance_max")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 2-rank run every interrupted-and-resumed run below must reproduce exactly."""
    ref = tmp_path_factory.mktemp("uninterrupted") / "ref"
    run_ranks(TRAIN, args=[*COMMON, f"run.dir={ref}"], timeout=240, reports=False)
    return ref


def _same_as(ref, d, what):
    want, got = _final(ref), _final(d)
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (what, k)
    a, b = (json.loads((x / "summary.json").read_text()) for x in (ref, d))
    assert {f: b[f] for f in SUMMARY_FIGURES} == {f: a[f] for f in SUMMARY_FIGURES}, what


@pytest.mark.multirank
def test_kill9_at_four_moments_then_resume_gives_identical_weights(tmp_path, uninterrupted):
    common = COMMON
    ref = uninterrupted
    K = json.loads((ref / "summary.json").read_text())["outer_steps"]

    def tmp_file_present(d):
        c = d / "checkpoints"
        return c.is_dir() and any(".tmp" in p.name for s in c.iterdir() if s.is_dir() for p in s.iterdir())

    moments = {
        "after the first checkpoint": (lambda d: checkpoint.latest_complete(d, 2) is not None, {}, None),
        # a later checkpoint is being written (the temporary file exists) while an earlier one is complete
        "during a checkpoint write": (lambda d: checkpoint.latest_complete(d, 2) is not None and tmp_file_present(d),
                                      {"PARLE_HVD_CKPT_DELAY": "0.5"}, None),
        "late in the run": (lambda d: _metrics_lines(d) >= 0.7 * K, {}, None),
        "rank 1 only, mid-run": (lambda d: _metrics_lines(d) >= 0.4 * K, {}, 1),
    }
    done = {}
    for i, (name, (cond, env, only_rank)) in enumerate(moments.items()):
        d = tmp_path / f"kill{i}"
        job = RankJob([TRAIN, *common, f"run.dir={d}"], env=env)
        _wait_for(lambda: cond(d), job, what=name)
        if only_rank is None:
            job.kill()                                  # SIGKILL to every process of the job
        else:
            rank_process(job, only_rank).kill()           # one rank dies; the launcher ends the rest
            job.wait(60)
            kill_tree(job.proc.pid)
        assert not (d / "summary.json").exists(), name
        done[name] = checkpoint.latest_complete(d, 2)
        assert done[name] is not None and done[name] < K, name
    # the four resumes one after the other in one start of the ranks (tests/ranks/sweep_rank.py)
    out = run_sweep([[*common, f"run.dir={tmp_path / f'kill{i}'}", "run.resume=true"] for i in range(len(moments))],
                    timeout=600)
    assert out[0]["_output"].count("resumed from checkpoint step") >= len(moments), out[0]["_output"]
    for i, name in enumerate(moments):
        d = tmp_path / f"kill{i}"
        assert json.loads((d / "summary.json").read_text())["resumed_from"] == done[name], name
        _same_as(ref, d, name)


@pytest.mark.multirank
def test_stop_at_an_evaluation_step_and_at_the_last_step_then_resume_matches_uninterrupted(tmp_path, uninterrupted):
    """A stop (SIGTERM's path, injected at an exact step) at an evaluation step still
    evaluates there, so the resumed run makes the same evaluations; a stop at K finishes
    the run; a resume from the last checkpoint with nothing left to train writes the same
    summary and final.pt. Every case ends identical to the uninterrupted run."""
    s0 = json.loads((uninterrupted / "summary.json").read_text())
    K, E = s0["outer_steps"], s0["evaluations"]
    assert K == 24 and E == 3                             # evaluations at steps 8, 16 and 24
    d = tmp_path / "eval_step"
    out = run_ranks(TRAIN, args=[*COMMON, f"run.dir={d}"], env={"PARLE_HVD_INJECT_STOP": "1:8"}, timeout=240,
                    reports=False)
    assert "stopped after outer step 8" in out[0]["_output"] and not (d / "summary.json").exists()
    assert checkpoint.latest_complete(d, 2) == 8
    assert sum("val/accuracy" in l for l in (d / "metrics.jsonl").read_text().splitlines()) == 1
    # its resume and the stop at K in one start of the ranks (tests/ranks/sweep_rank.py)
    last = tmp_path / "last_step"
    run_sweep([[*COMMON, f"run.dir={d}", "run.resume=true"], [*COMMON, f"run.dir={last}"]],
              run_env=[None, {"PARLE_HVD_INJECT_STOP": "0:24"}], timeout=400)
    _same_as(uninterrupted, d, "a stop at an evaluation step")

    d = last
    _same_as(uninterrupted, d, "a stop at K")
    (d / "summary.json").unlink()
    (d / "final.pt").unlink()          # as if killed after the last checkpoint, before the results
    out = run_ranks(TRAIN, args=[*COMMON, f"run.dir={d}", "run.resume=true"], timeout=240, reports=False)
    assert "resumed from checkpoint step 24" in out[0]["_output"]
    _same_as(uninterrupted, d, "a resume with nothing left to train")


@pytest.mark.multirank
def test_a_torn_newest_checkpoint_is_skipped_and_the_previous_one_resumed(tmp_path, uninterrupted):
    """A checkpoint every outer step, stopped after step 6; the newest rank-1.pt cut to half
    its size (a node lost mid-write on a shared filesystem). The ranks agree on step 5,
    say which step was skipped and why, set step 6 aside, and end identical to the
    uninterrupted run. With every step torn on rank 1 the resume ends at once: exit 2."""
    import shutil
    d = tmp_path / "run"
    run_ranks(TRAIN, args=[*COMMON, "run.ckpt_every=1", f"run.dir={d}"], env={"PARLE_HVD_INJECT_STOP": "0:6"},
              timeout=240, reports=False)
    assert checkpoint.complete_steps(d, 2) == [6, 5]
    both = tmp_path / "both"
    shutil.copytree(d, both)
    f = checkpoint.step_dir(d, 6) / "rank-1.pt"
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
    out = run_ranks(TRAIN, args=[*COMMON, "run.ckpt_every=1", f"run.dir={d}", "run.resume=true"], timeout=240,
                    reports=False)
    o = out[0]["_output"]
    assert "[rank 1] run.resume: skipping checkpoint step 6, which does not load here" in o, o
    assert "cannot be read" in o and "resuming from step 5" in o and "resumed from checkpoint step 5" in o
    assert (d / "checkpoints" / "unreadable-step-00000006" / "rank-1.pt").is_file()
    _same_as(uninterrupted, d, "a torn newest checkpoint")

    for s_ in (5, 6):
        f = checkpoint.step_dir(both, s_) / "rank-1.pt"
        f.write_bytes(f.read_bytes()[:100])
    t0 = time.monotonic()
    out = run_ranks(TRAIN, args=[*COMMON, f"run.dir={both}", "run.resume=true"], timeout=120, reports=False,
                    expect_fail=True)
    o = out[0]["_output"]
    assert out[0]["_rc"] != 0 and time.monotonic() - t0 < 60, o
    assert "no checkpoint in" in o and "loads on every rank" in o and "stopped answering" not in o, o
    assert checkpoint.complete_steps(both, 2) == [6, 5]            # nothing removed


@pytest.mark.multirank
def test_a_checkpoint_write_failing_on_one_rank_stops_every_rank_at_once(tmp_path):
    """Rank 1's disk is full (a file-size limit): it cannot write its checkpoint of step 2.
    Every rank stops at the next sync with exit 2 and the real message, long before
    dist.timeout (300 s), no rank blamed for silence; rank 0's checkpoint stays."""
    d = tmp_path / "run"
    t0 = time.monotonic()
    out = run_ranks(TRAIN, args=[*CFG, *SMALL, "train.epochs=3", "run.ckpt_every=2", f"run.dir={d}"],
                    env={"PARLE_TEST_RANK1_FSIZE": "200000"}, timeout=240, reports=False, expect_fail=True)
    elapsed = time.monotonic() - t0
    o = out[0]["_output"]
    print(f"\ncheckpoint failure on rank 1 -> job exit {out[0]['_rc']} after {elapsed:.1f} s")
    assert out[0]["_rc"] != 0 and elapsed < 60, (elapsed, o)
    # each line tagged with its rank: "[1]<stderr>:" (horovodrun) or "[1]:" (torchrun)
    assert re.search(r"^\[1\](<stderr>)?:error: run.dir: rank 1 cannot write checkpoint step 2", o, re.M), o
    assert re.search(r"^\[0\](<stderr>)?:error: run.dir: rank\(s\) \[1\] could not write their checkpoint", o, re.M), o
    assert "stopped after outer step 3" in o and "stopped answering" not in o
    # no checkpoint was complete yet: every rank's line says so (rank 1's and rank 0's)
    assert o.count("no complete checkpoint was written yet: nothing to resume from") >= 1, o
    assert o.count("No complete checkpoint was written yet: nothing to resume from") >= 1, o
    assert "step None" not in o, o
    assert (checkpoint.step_dir(d, 2) / "rank-0.pt").is_file() and checkpoint.latest_complete(d, 2) is None
    assert not (d / "summary.json").exists()


# ------------------------------------------------------------------------ launchers
@pytest.mark.multirank
@pytest.mark.parametrize("script", [pytest.param("launch/local.sh", marks=pytest.mark.horovod),  # horovodrun
                                    "launch/torchrun.sh"])
def test_launch_script_ends_with_the_failing_ranks_line_and_its_exit_code(tmp_path, script):
    """launch/local.sh (what `make run` uses) and launch/torchrun.sh: a bad input exits 2
    and a divergence 3, each ending with the rank's own error line; the launcher's
    traceback is kept out of sight, in a log file named one line above."""
    from multirank import VENV_BIN, run_command
    venv = os.path.relpath(VENV_BIN.parent, ROOT)
    log = tmp_path / "launcher.log"
    env = {"VENV": venv, "PARLE_HVD_LAUNCHER_LOG": str(log)}
    rc, out = run_command([script, "train.epochs=-1"], env=env, timeout=120)
    lines = [l for l in out.splitlines() if l.strip()]
    assert rc == 2, out
    assert lines[-1].endswith("error: train.epochs: must be > 0, got -1.0"), out
    assert "Traceback" not in out and "Horovod detected" not in out and "torch/distributed" not in out, out
    assert f"the launcher's report is in {log}" in lines[-2] and "Traceback" in log.read_text()
    log.unlink()
    rc, out = run_command([script, *SMALL, "train.epochs=1", f"run.dir={tmp_path / 'div'}"],
                          env={**env, "PARLE_HVD_INJECT_NAN": "1:2"}, timeout=180)
    lines = [l for l in out.splitlines() if l.strip()]
    assert rc == 3, out
    assert "error: non-finite loss or weights on rank(s) [1] at outer step 2" in lines[-1], out
    assert lines[-1].endswith("No complete checkpoint was written yet: nothing to resume from"), out
    assert "Traceback" not in out and "Traceback" in log.read_text()


def test_the_launcher_ends_with_the_first_failing_ranks_line(tmp_path, capfd, monkeypatch):
    """Two ranks print error lines: rank 1 failed first (its own stuck workers, say) and
    rank 0 then said that a rank left. horovodrun's report names the first to exit ("Process
    name: 1" followed by "Exit code: 2", not at the end of the report): that rank's line is
    the one printed last, with its code."""
    from parle_hvd import launcher
    fake = tmp_path / "fake_horovodrun.py"
    fake.write_text(
        "import sys\n"
        "print('[1]<stderr>:error: rank 1: data.workers (train): one is stuck', file=sys.stderr, flush=True)\n"
        "print('[0]<stderr>:error: rank 0: another rank left the job', file=sys.stderr, flush=True)\n"
        "print('Traceback (most recent call last):', file=sys.stderr)\n"
        "print('RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus causing "
        "the job to be terminated. The first process to do so was:', file=sys.stderr)\n"
        "print('Process name: 1', file=sys.stderr)\nprint('Exit code: 2', file=sys.stderr)\nsys.exit(1)\n")
    monkeypatch.setenv("PARLE_HVD_LAUNCHER_LOG", str(tmp_path / "report.log"))
    rc = launcher.main(["--", sys.executable, str(fake)])
    err = [l for l in capfd.readouterr().err.splitlines() if l.strip()]
    assert rc == 2 and err[-1] == "[1]<stderr>:error: rank 1: data.workers (train): one is stuck", err
    assert "Traceback" not in "\n".join(err) and "Process name: 1" in (tmp_path / "report.log").read_text()


# ------------------------------------------------------------------------ signals
@pytest.mark.multirank
def test_sigterm_on_one_rank_stops_all_with_checkpoint_and_exit_0(tmp_path):
    d = tmp_path / "run"
    job = RankJob([TRAIN, *CFG, *SMALL, "train.epochs=50", "run.ckpt_every=1000", f"run.dir={d}"])
    _wait_for(lambda: _metrics_lines(d) >= 3, job, what="training")
    t0 = time.monotonic()
    rank_process(job, 1).send_signal(signal.SIGTERM)      # as SLURM does before a preemption
    rc = job.wait(60)
    elapsed = time.monotonic() - t0
    print(f"\nSIGTERM to rank 1 -> job exit {rc} after {elapsed:.2f} s")
    assert rc == 0, job.output
    assert elapsed < 10, elapsed
    assert "stopped after outer step" in job.output and "SIGTERM" in job.output
    step = checkpoint.latest_complete(d, 2)
    assert step is not None and step >= 3
    # and the run continues from there
    out = run_ranks(TRAIN, args=[*CFG, *SMALL, "train.epochs=1", f"run.dir={d}", "run.resume=true"],
                    timeout=120, reports=False, expect_fail=True)
    assert "resumed from checkpoint step" in out[0]["_output"]


def test_a_failed_rank_waiting_for_rank_0_to_speak_ends_at_the_launchers_sigterm():
    """A rank other than 0 that failed waits up to 3 s so that rank 0's line gets out; the
    launcher's SIGTERM (sent once rank 0 has exited) ends that wait at once, even with the
    run's own SIGTERM handler (a stop request) still installed, and gives that handler back."""
    code = ("import signal, sys, time\n"
            "from parle_hvd.cli import _let_rank0_speak\n"
            "mine = lambda s, f: None\n"
            "signal.signal(signal.SIGTERM, mine)\n"
            "print('waiting', flush=True)\n"
            "t0 = time.monotonic()\n"
            "_let_rank0_speak(30.0)\n"
            "print(f'waited {time.monotonic() - t0:.2f}', signal.getsignal(signal.SIGTERM) is mine, flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert p.stdout.readline().strip() == "waiting"
        time.sleep(0.3)
        t0 = time.monotonic()
        while p.poll() is None and time.monotonic() - t0 < 10:
            p.send_signal(signal.SIGTERM)     # again until it ends: one sent before the wait began goes to `mine`
            time.sleep(0.1)
        rc = p.wait(timeout=10)
    finally:
        p.kill()
    waited, restored = p.stdout.read().split()[1:]
    assert rc == 0 and float(waited) < 5 and restored == "True", (rc, waited, restored)


def test_second_sigint_exits_at_once(tmp_path):
    # long outer steps (L = 400) so that only the second SIGINT can explain a quick exit
    p = subprocess.Popen([sys.executable, "train.py", *CFG, "dist.backend=none", "parle.sync_period=400",
                          "train.batch_size=32", "run.progress=lines", f"run.dir={tmp_path / 'r'}"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ,
                                                                                          "PYTHONPATH": str(ROOT)})
    t0 = time.monotonic()
    while not (tmp_path / "r" / "run.json").exists():
        assert time.monotonic() - t0 < 60 and p.poll() is None
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t1 = time.monotonic()
    p.send_signal(signal.SIGINT)
    rc = p.wait(timeout=10)
    out = p.stdout.read().decode()
    assert rc == 130 and time.monotonic() - t1 < 2, (rc, out)
    assert "second SIGINT: exiting now" in out


def test_sigterm_while_loading_exits_at_once_and_keeps_the_checkpoints(tmp_path, finished_run):
    """A resume whose data loading takes a minute gets SIGTERM mid-load: nothing is trained
    yet, so it ends at once (not after the load and one outer step) with one line and exit
    143, and the checkpoints it was resuming from are untouched."""
    import shutil
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    before = _digest(d)
    p = subprocess.Popen([sys.executable, "train.py", *CFG, *SMALL, "dist.backend=none", "train.epochs=1",
                          "run.ckpt_every=1", f"run.dir={d}", "run.resume=true"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                        "PARLE_HVD_INJECT_SLOW_LOAD": "0:60"})
    try:
        hb, t0 = d / ".heartbeat" / "rank-0", time.monotonic()
        while not (hb.exists() and "busy:loading_data" in hb.read_text()):
            assert time.monotonic() - t0 < 60 and p.poll() is None, p.stdout.read().decode() if p.poll() is not None else ""
            time.sleep(0.05)
        t1 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
    finally:
        p.kill()
    out = p.stdout.read().decode()
    assert rc == 143 and time.monotonic() - t1 < 3, (rc, time.monotonic() - t1, out)
    assert out.strip().splitlines()[-1] == ("[rank 0] SIGTERM while loading data: stopped before the first outer step "
                                            "(nothing trained, no checkpoint to write)"), out
    assert "Traceback" not in out
    assert _digest(d) == before


# ------------------------------------------------------------------------ divergence
@pytest.mark.multirank
def test_divergence_on_one_rank_names_it_and_keeps_the_last_checkpoint(tmp_path):
    d = tmp_path / "run"
    out = run_ranks(TRAIN, args=[*CFG, *SMALL, "train.epochs=3", "run.ckpt_every=3", f"run.dir={d}"],
                    env={"PARLE_HVD_INJECT_NAN": "1:7"}, timeout=120, reports=False, expect_fail=True)
    o = out[0]["_output"]
    assert out[0]["_rc"] != 0
    assert "non-finite loss or weights on rank(s) [1] at outer step 7" in o, o
    assert "last complete checkpoint (step 6)" in o
    # no traceback from our ranks (horovodrun itself prints one when a worker exits non-zero)
    ranks_out = "\n".join(l for l in o.splitlines() if l.startswith(("[0]<", "[1]<")))
    assert "Traceback" not in ranks_out, ranks_out
    assert checkpoint.latest_complete(d, 2) == 6 and not checkpoint.step_dir(d, 7).exists()
    st = checkpoint.load(d, 6, 1)
    assert all(bool(torch.isfinite(v).all()) for v in st["model"].values() if v.is_floating_point())


# ------------------------------------------------------------------------ a silent rank
@pytest.mark.multirank
def test_silent_rank_is_named_within_the_timeout(tmp_path):
    d = tmp_path / "run"
    job = RankJob([TRAIN, *CFG, *SMALL, "train.epochs=50", "dist.timeout=8", f"run.dir={d}"])
    try:
        _wait_for(lambda: _metrics_lines(d) >= 3, job, what="training")
        victim = rank_process(job, 1)
        victim.suspend()                                 # SIGSTOP: alive, silent
        t0 = time.monotonic()
        # named within the timeout; the job's end then depends on the launcher (torchrun
        # gives a worker that ignores its SIGTERM 30 s before SIGKILL: this one is stopped)
        while "rank 1 stopped answering" not in job.output and time.monotonic() - t0 < 8 + 15:
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        # named: let the stopped rank run again, so that the launcher's SIGTERM ends it now
        # rather than its SIGKILL after the grace period (horovodrun: 10 s measured)
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.resume()
        rc = job.wait(120)
    finally:
        kill_tree(job.proc.pid)
    print(f"\nrank 1 stopped -> named after {elapsed:.1f} s, job exit {rc}")
    assert rc != 0 and elapsed < 8 + 15, (rc, elapsed)
    assert "waited 8 s in the sync collective" in job.output and "rank 1 stopped answering" in job.output, job.output


# ------------------------------------------------------------------------ bad input
def _digest(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file() and ".heartbeat" not in p.parts}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A complete 1-process run with checkpoints, for the resume cases."""
    d = tmp_path_factory.mktemp("done") / "run"
    r = subprocess.run([sys.executable, "train.py", *CFG, *SMALL, "dist.backend=none", "train.epochs=0.5",
                        "run.ckpt_every=1", f"run.dir={d}"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return d


@pytest.fixture(scope="module")
def two_rank_checkpoint(finished_run, tmp_path_factory):
    """The finished run's newest checkpoint, relabelled as written by a 2-rank job."""
    import shutil
    d = tmp_path_factory.mktemp("w2") / "run"
    shutil.copytree(finished_run, d)
    step = checkpoint.latest_complete(d, 1)
    st = checkpoint.load(d, step, 0)
    st["world"] = 2
    checkpoint.atomic_save(st, checkpoint.step_dir(d, step) / "rank-0.pt")
    return d


def _limit_fsize():
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))


def _bad_cases(tmp, done, done2):
    trunc = tmp / "trunc"
    trunc.mkdir(exist_ok=True)
    for f in FASHION.iterdir():
        (trunc / f.name).write_bytes(f.read_bytes())
    t = trunc / "t10k-labels-idx1-ubyte.gz"
    t.write_bytes(t.read_bytes()[:-40])
    badyaml = tmp / "bad.yaml"
    badyaml.write_text("parle:\n  sync_period: [1, 2\n")
    cifar = tmp / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True, exist_ok=True)
    for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (cifar / n).write_bytes(b"\x80\x02}q\x00(garbage")
    ro = tmp / "ro"
    ro.mkdir(exist_ok=True)
    return [
        ("missing dataset directory", ["data.dir=/nonexistent/fashion"], "/nonexistent/fashion does not exist", None),
        ("truncated dataset file", [f"data.dir={trunc}"], "t10k-labels-idx1-ubyte.gz: cannot read", None),
        ("corrupt CIFAR pickles", ["data.name=cifar10", f"data.dir={cifar.parent}", "model.name=allcnn"],
         "truncated or corrupt CIFAR pickle", None),
        ("YAML syntax error", ["--config", str(badyaml)], "YAML syntax error", None),
        ("unknown config key", ["parle.sync_perod=3"], "parle.sync_perod: unknown key", None),
        ("wrong type", ["train.epochs=lots"], "train.epochs: expected a number", None),
        ("L < 1", ["parle.sync_period=0"], "parle.sync_period: must be >= 1", None),
        ("negative lr", ["optim.lr=-0.1"], "optim.lr: must be > 0", None),
        ("frac not in (0, 1]", ["data.split=frac", "data.frac=1.5"], "data.frac: must be in (0, 1]", None),
        ("batch larger than a replica's data", ["data.train_limit=100", "train.batch_size=128"],
         "larger than a replica's data", None),
        ("world size the config cannot use", ["dist.expect_ranks=3"], "meant for 3 ranks, launched with 1", None),
        ("unwritable run directory", ["run.dir=/proc/parle"], "run.dir: cannot write", None),
        ("resume with no checkpoint", [f"run.dir={ro}", "run.resume=true"], "no complete checkpoint", None),
        ("checkpoint from another model", [f"run.dir={done}", "run.resume=true", "model.name=allcnn"],
         "is for parle on 1 ranks with 132220 parameters", done),
        ("checkpoint from another world size", [f"run.dir={done2}", "run.resume=true"],
         "is for parle on 2 ranks", done2),
        ("full disk during a checkpoint", [f"run.dir={done}", "run.resume=true", "train.epochs=2", "run.ckpt_every=1",
                                           "parle.sync_period=5"],
         "cannot write checkpoint", done),
        ("unknown algorithm", ["algo=adam"], "algo: must be one of", None),
        ("elastic mode with an algorithm without a reference", ["algo=dpsgd", "--elastic"],
         "dist.elastic: needs an algorithm with a reference", None),
        ("unknown command-line flag", ["--bogus"], "unrecognized arguments: --bogus", None),
        ("unknown precision", ["train.precision=fp8"], "train.precision: must be one of", None),
        ("no micro-batch", ["train.accum=0"], "train.accum: must be >= 1", None),
        ("BatchNorm micro-batches of one example", ["model.name=resnet18", "train.batch_size=8", "train.accum=8"],
         "train.accum: micro-batches of 1 example(s)", None),
        ("compile neither true nor false", ["train.compile=maybe"], "train.compile: expected", None),
        ("autocast of float64 weights", ["train.precision=bf16", "model.dtype=float64"],
         "train.precision: bf16 autocasts float32 weights", None),
        ("elastic mode outside horovodrun's elastic mode", ["dist.elastic=true"],
         "dist.elastic: start the job with horovodrun's elastic mode", None),
    ]


def _run_dirs() -> set:
    return set((ROOT / "runs").iterdir()) if (ROOT / "runs").is_dir() else set()


def _refuse(name, args, cwd=ROOT):
    """train.py with a bad input, run from ``cwd`` (where a default run.dir, runs/..., would go)."""
    argv = [*args[:2], *SMALL[:2], *args[2:]] if args[:1] == ["--config"] else [*CFG, *SMALL[:2], *args]
    argv = [str(ROOT / a) if a == CFG[1] else a for a in argv]
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *argv, "dist.backend=none", "run.progress=lines"],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          preexec_fn=_limit_fsize if "full disk" in name else None)


def test_bad_input_table(tmp_path, finished_run, two_rank_checkpoint):
    cases = _bad_cases(tmp_path, finished_run, two_rank_checkpoint)
    assert len(cases) >= 15
    runs_before = _run_dirs()
    # Cases with nothing to protect run two at a time (each is mostly torch's import, on one
    # core), each from its own directory, so that a run directory one of them left behind
    # (runs/... by default) is its own; those that must leave a run untouched run alone.
    from concurrent.futures import ThreadPoolExecutor
    free = [(c, tmp_path / f"cwd{i}") for i, c in enumerate(cases) if c[3] is None]
    for _, cwd in free:
        cwd.mkdir()
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda c: (_refuse(c[0][0], c[0][1], c[1]), c[1]), free))
    results = [(c, r) for (c, _), r in zip(free, done)] + [(c, None) for c in cases if c[3] is not None]
    for (name, args, needle, protect), r in results:
        before = _digest(protect) if protect else None
        r, cwd = r or (_refuse(name, args), None)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert r.returncode == 2, (name, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and len(lines) == 1 and lines[0].startswith("error: "), (name, r.stderr)
        assert needle in lines[0], (name, lines[0])
        if protect:
            after = _digest(protect)
            # checkpoints and the finished run's results are never touched; a refused resume
            # touches nothing at all (a resume that fails later may append to the logs)
            keep = {k for k in before if k.startswith("checkpoints/") or k in ("final.pt", "summary.json")} \
                if "full disk" in name else set(before)
            assert {k: after.get(k) for k in keep} == {k: before[k] for k in keep}, f"{name}: a file was changed"
        # a run that failed before it started leaves no (empty) run directory behind
        assert _run_dirs() == runs_before, (name, _run_dirs() - runs_before)
        assert cwd is None or list(cwd.iterdir()) == [], (name, list(cwd.iterdir()))
    new_dir = tmp_path / "new"             # a run.dir this start created, then refused: removed again
    r = subprocess.run([sys.executable, "train.py", *CFG, f"run.dir={new_dir}", "run.resume=true",
                        "dist.backend=none"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "no complete checkpoint" in r.stderr and not new_dir.exists(), r.stderr
