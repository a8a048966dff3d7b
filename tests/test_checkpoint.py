"""Checkpoint files: which step is complete for a world size, and pruning, including the
leftovers of an elastic run that shrank (files of ranks that no longer exist)."""
import torch

from parle_hvd import checkpoint


def _write(root, step, ranks):
    for r in ranks:
        checkpoint.atomic_save({"step": step, "rank": r}, checkpoint.step_dir(root, step) / f"rank-{r}.pt")


def test_latest_complete_needs_every_rank_and_no_extra_one(tmp_path):
    _write(tmp_path, 3, [0, 1, 2])          # written by 3 ranks
    _write(tmp_path, 6, [0, 1])             # after the world shrank to 2
    _write(tmp_path, 9, [0])                # rank 1 was killed before writing step 9
    assert checkpoint.latest_complete(tmp_path, 2) == 6
    assert checkpoint.latest_complete(tmp_path, 3) == 3
    assert checkpoint.latest_complete(tmp_path, 1) == 9         # for one rank, step 9 is whole
    assert checkpoint.load(tmp_path, 6, 1) == {"step": 6, "rank": 1}


def test_prune_keeps_the_newest_complete_step_and_clears_dead_ranks_files(tmp_path):
    _write(tmp_path, 3, [0, 1, 2])
    _write(tmp_path, 6, [0, 1, 2])
    for step in (9, 12):                    # the world shrank to ranks 0 and 1
        for r in (1, 0):                    # rank 1 first, so rank 0 prunes last
            _write(tmp_path, step, [r])
            checkpoint.prune(tmp_path, r, keep=2)
    assert checkpoint.steps(tmp_path) == [9, 12]
    assert not any(p.name == "rank-2.pt" for p in (tmp_path / "checkpoints").rglob("*.pt"))
    assert checkpoint.latest_complete(tmp_path, 2) == 12


def test_prune_by_rank_zero_never_removes_a_step_a_slower_rank_still_needs(tmp_path):
    for step in (3, 6):
        _write(tmp_path, step, [0, 1])
    _write(tmp_path, 9, [0])                # rank 0 is one checkpoint ahead of rank 1
    checkpoint.prune(tmp_path, 0, keep=2)
    assert checkpoint.latest_complete(tmp_path, 2) == 6
    assert torch.load(checkpoint.step_dir(tmp_path, 6) / "rank-1.pt")["rank"] == 1


def test_a_checkpoint_from_before_weights_only_files_still_loads_and_restores_numpy(tmp_path):
    """Files written before the numpy RNG state was stored as a tensor pickled numpy's state
    tuple: torch.load(weights_only=True) refuses them, so load and latest_complete_any read
    them the old way, and the trainer restores the tuple as it was. A file that is merely
    torn is still refused."""
    import numpy as np
    import pickle
    import pytest
    from parle_hvd.assemble import rng_state, set_rng_state
    cpu = torch.device("cpu")
    np.random.seed(7)
    old = np.random.get_state()
    checkpoint.atomic_save({"step": 4, "world": 1, "rng_np": old}, checkpoint.step_dir(tmp_path, 4) / "rank-0.pt")
    with pytest.raises(pickle.UnpicklingError):
        torch.load(checkpoint.step_dir(tmp_path, 4) / "rank-0.pt", weights_only=True)
    st = checkpoint.load(tmp_path, 4, 0)
    assert checkpoint.latest_complete_any(tmp_path) == (4, 1)
    want = np.random.rand(3)
    np.random.seed(0)
    set_rng_state({**rng_state(cpu), "rng_np": st["rng_np"]}, cpu)   # the old tuple
    assert np.array_equal(np.random.rand(3), want)
    np.random.seed(7)
    new = rng_state(cpu)["rng_np"]                 # the new form: tensors and numbers only
    checkpoint.atomic_save({"step": 5, "world": 1, "rng_np": new}, checkpoint.step_dir(tmp_path, 5) / "rank-0.pt")
    got = torch.load(checkpoint.step_dir(tmp_path, 5) / "rank-0.pt", weights_only=True)["rng_np"]
    np.random.seed(0)
    set_rng_state({**rng_state(cpu), "rng_np": got}, cpu)
    assert np.array_equal(np.random.rand(3), want)
    f = checkpoint.step_dir(tmp_path, 5) / "rank-0.pt"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(checkpoint.CheckpointError, match="cannot be read"):
        checkpoint.load(tmp_path, 5, 0)
