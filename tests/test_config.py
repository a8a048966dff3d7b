"""Configuration: YAML + overrides, rejection with the key named, --help, and the CLI's
one-line exit-2 errors for bad input."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parle_hvd.config import Config, ConfigError, help_text, make_config

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_and_overrides():
    c = make_config(ROOT / "configs/fashion_parle.yaml", ["parle.sync_period=50", "train.epochs=3",
                                                           "optim.milestones=[1, 2.5]", "run.tensorboard=false"])
    assert c.parle.sync_period == 50 and c.train.epochs == 3.0 and c.optim.milestones == [1.0, 2.5]
    assert c.run.tensorboard is False and c.run.name == "fashion_parle"
    assert c.data.name == "fashion-mnist"
    assert isinstance(make_config(None), Config)


@pytest.mark.parametrize("override,needle", [
    ("parle.sync_perod=3", "parle.sync_perod: unknown key"),
    ("nosuch.key=1", "nosuch: unknown key"),
    ("parle.sync_period=abc", "parle.sync_period: expected an integer"),
    ("parle.sync_period=2.5", "parle.sync_period: expected an integer"),
    ("train.epochs=true", "train.epochs: expected a number"),
    ("run.resume=maybe", "run.resume: expected true or false"),
    ("optim.milestones=3", "optim.milestones: expected a list"),
    ("parle.sync_period=0", "parle.sync_period: must be >= 1"),
    ("optim.lr=-0.1", "optim.lr: must be > 0"),
    ("data.frac=0", "data.frac: must be in (0, 1]"),
    ("data.frac=1.5", "data.frac: must be in (0, 1]"),
    ("algo=sgdx", "algo: must be one of"),
    ("data.name=imagenet", "data.name: must be one of"),
    ("parle=3", "parle: expected a mapping"),
    ("run.keep=1", "run.keep: must be >= 2"),
    ("noequals", "overrides are key.sub=value"),
])
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        make_config(None, [override])
    assert needle in str(e.value)


def test_help_lists_every_key_with_default_and_meaning():
    h = help_text()
    import dataclasses
    import typing

    def keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                yield from keys(tp, f"{prefix}{f.name}.")
            else:
                yield f"{prefix}{f.name}", f
    for key, f in keys(Config):
        line = next((l for l in h.splitlines() if l.split()[0] == key), None)
        assert line is not None, key
        assert "default" in line and f.metadata["help"] in line


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "train.py", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def test_cli_help():
    r = _cli("--help")
    assert r.returncode == 0 and "parle.sync_period" in r.stdout and "horovodrun" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["parle.sync_period=0"], "parle.sync_period"),
    (["--config", "configs/nope.yaml"], "no such file"),
    (["data.dir=/nonexistent/fm", "dist.backend=none"], "/nonexistent/fm does not exist"),
    (["bogus.key=1"], "bogus: unknown key"),
    (["run.dir=/proc/forbidden", "dist.backend=none"], "run.dir: cannot write"),
    (["run.resume=true", "run.dir=EMPTY", "dist.backend=none"], "no complete checkpoint"),
    (["train.batch_size=5000", "data.train_limit=1000", "dist.backend=none"], "larger than a replica's data"),
    (["algo=entropy", "parle.balance=time", "parle.overlap=true"], "parle.overlap: is Parle's only"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, args, needle):
    args = [a.replace("EMPTY", str(tmp_path)) for a in args]
    r = _cli("--config", "configs/fashion_parle.yaml", *args) if "--config" not in args else _cli(*args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr


def test_cli_yaml_syntax_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("parle:\n  sync_period: [1, 2\n")
    r = _cli("--config", str(bad))
    assert r.returncode == 2 and "YAML syntax error" in r.stderr and "line" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_preset_loads_and_states_its_launch_line(path):
    import re
    c = make_config(path)
    head = "\n".join(l for l in path.read_text().splitlines() if l.startswith("#"))
    launch = [l for l in head.splitlines() if "train.py --config configs/" + path.name in l]
    assert launch, f"{path.name}: no launch line in the header comment"
    for l in launch:
        m = re.search(r"-np (\d+)", l)
        if m and c.dist.expect_ranks:
            assert int(m.group(1)) == c.dist.expect_ranks
    if path.stem.startswith("fashion_"):
        assert c.data.name == "fashion-mnist" and c.train.epochs == 20 and c.optim.milestones == [12.0, 17.0]
        assert c.algo == path.stem.split("_", 1)[1]


def test_paper_presets_cover_every_row():
    rows = {"lenet_mnist_parle": ("mnist", "lenet", 6, 1.0), "allcnn_cifar10_parle": ("cifar10", "allcnn", 3, 1.0),
            "allcnn_cifar10_split_half": ("cifar10", "allcnn", 3, 0.5),
            "allcnn_cifar10_split_quarter": ("cifar10", "allcnn", 6, 0.25),
            "wrn28_10_cifar10": ("cifar10", "wrn", 3, 1.0), "wrn28_10_cifar100": ("cifar100", "wrn", 3, 1.0)}
    for name, (data, model, n, frac) in rows.items():
        c = make_config(ROOT / "configs" / f"{name}.yaml")
        assert (c.data.name, c.model.name, c.dist.expect_ranks) == (data, model, n)
        assert c.data.frac == frac and (c.data.split == "frac") == (frac < 1)
        assert c.train.epochs == 125 and c.parle.sync_period == 25   # 5 authors' epochs of L = 25 passes


def test_elastic_mode_algorithms_are_those_with_a_per_replica_reference():
    # config.py names them without importing the algorithms; keep the two in step
    from parle_hvd.algorithms import ALGORITHMS
    from parle_hvd.config import ELASTIC_ALGOS
    assert set(ELASTIC_ALGOS) == {n for n, a in ALGORITHMS.items() if a.syncs and not a.shard_data}
    for algo in ALGORITHMS:
        if algo in ELASTIC_ALGOS:
            assert make_config(None, [f"algo={algo}", "dist.elastic=true"]).dist.elastic
        else:
            with pytest.raises(ConfigError, match="dist.elastic: needs an algorithm with a reference"):
                make_config(None, [f"algo={algo}", "dist.elastic=true"])


def test_scoping_is_a_number_or_auto_and_val_frac_and_elastic_momentum_are_checked():
    assert make_config(None, ["parle.scoping=auto"]).parle.scoping == "auto"
    assert make_config(None, ["parle.scoping=0.25"]).parle.scoping == 0.25
    assert make_config(None, ["parle.scoping=1"]).parle.scoping == 1.0
    for bad, key in (("parle.scoping=fast", "parle.scoping: must be a number >= 0 or auto"),
                     ("parle.scoping=-1", "parle.scoping: must be a number >= 0 or auto"),
                     ("parle.scoping=[1]", "parle.scoping: expected a number or a word"),
                     ("parle.scoping_end=0", "parle.scoping_end: must be in (0, 1]"),
                     ("data.val_frac=1.0", "data.val_frac: must be in [0, 1)"),
                     ("elastic.momentum=1.0", "elastic.momentum: must be in [0, 1)")):
        with pytest.raises(ConfigError, match=re.escape(key)):
            make_config(None, [bad])


def test_a_bare_off_or_on_stays_a_word_where_a_string_is_expected(tmp_path):
    """YAML 1.1 reads off/on as booleans: parle.balance=off must still mean "off" (it made
    every rank exit 2 before), and a word outside the choices still names the field."""
    assert make_config(None, ["parle.balance=off"]).parle.balance == "off"
    assert make_config(None, ["parle.balance=time"]).parle.balance == "time"
    f = tmp_path / "c.yaml"
    f.write_text("parle:\n  balance: off\n")
    assert make_config(str(f), []).parle.balance == "off"
    with pytest.raises(ConfigError, match="parle.balance: must be one of off, time, got 'on'"):
        make_config(None, ["parle.balance=on"])


def test_exponent_without_a_dot_is_a_number():
    """PyYAML (YAML 1.1) leaves 1e-4 a string; a float field takes it as the number a user means."""
    assert make_config(None, ["optim.weight_decay=1e-4"]).optim.weight_decay == 1e-4
    assert make_config(None, ["optim.lr=5E-2"]).optim.lr == 0.05
    with pytest.raises(ConfigError, match="optim.weight_decay: expected a number, got '1e-4x'"):
        make_config(None, ["optim.weight_decay=1e-4x"])


@pytest.mark.parametrize("override,needle", [
    ("parle.overlap=true", "parle.overlap: not supported with dist.elastic"),
    ("parle.balance=time", "parle.balance: not supported with dist.elastic"),
])
def test_overlap_and_balance_are_refused_in_elastic_mode(override, needle):
    with pytest.raises(ConfigError, match=needle):
        make_config(None, ["dist.elastic=true", override])
    # Parle's keys only: any other algorithm refuses them, elastic or not (issue 21, item 3)
    with pytest.raises(ConfigError, match=override.split("=")[0] + ": is Parle's only"):
        make_config(None, ["dist.elastic=true", override, "algo=localsgd"])


@pytest.mark.parametrize("algo", ["entropy", "sgd", "dpsgd", "elastic", "localsgd", "diloco"])
@pytest.mark.parametrize("override", ["parle.overlap=true", "parle.balance=time"])
def test_overlap_and_balance_are_parles_only(algo, override):
    """algo=entropy inherited Parle's overlap and balance: rank 0's replica, the one evaluated,
    ran fewer inner steps than asked. Every algorithm but Parle refuses them: one line, exit 2."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: is Parle's only \\(algo=parle\\), not algo={algo}"):
        make_config(None, [f"algo={algo}", override])
    assert make_config(None, [f"algo={algo}", key + ("=false" if "overlap" in key else "=off")]).algo == algo
