"""A training script of a user's own (model, loader, loss, loop) with Parle as its optimizer.

    horovodrun -np 2 -H localhost:2 python examples/own_loop.py --epochs 2
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --epochs 2
    ... --algo localsgd   (or diloco, elastic, sgd: one word changes the algorithm)

For Parle the same run through train.py gives the same final weights, to the bit in
float64 (tests/test_examples.py): train.py --config configs/fashion_parle.yaml
model.target=examples/own_loop.py:Net optim.schedule=constant eval.bn_batches=0 ...
(dpsgd in train.py shards the data, where this script gives every rank all of it).
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import parle_hvd
from parle_hvd.data import ReplicaSampler, load_dataset, to_input


class Net(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 5), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Dropout(0.25), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--algo", default="parle")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sync-period", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--train-limit", type=int, default=2048)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--out", default="own_loop_final.pt")
    a = p.parse_args()

    parle_hvd.init()                                   # Horovod or torch.distributed, whichever launched us
    rank, dtype = parle_hvd.rank(), getattr(torch, a.dtype)
    ds = load_dataset("fashion-mnist", "/usr/share/datasets/fashion-mnist", a.train_limit, 1000)
    torch.manual_seed(a.seed + rank)                   # each replica its own initialisation (PARLE.md)
    model = Net().to(dtype)
    # each replica its own order of the whole training set, deterministic by seed and rank
    sampler = ReplicaSampler(torch.arange(len(ds.train_x)), a.batch_size, seed=a.seed, rank=rank)
    # its own generator: a DataLoader draws a seed at every pass, from torch's global stream
    # otherwise, which would shift dropout's draws
    loader = DataLoader(TensorDataset(ds.train_x, ds.train_y), batch_sampler=sampler, generator=torch.Generator())
    opt = parle_hvd.optim.make(a.algo, model, lr=a.lr, sync_period=a.sync_period, batches_per_pass=len(loader),
                               seed=a.seed)
    for epoch in range(a.epochs):
        for x, y in loader:
            loss = F.cross_entropy(opt.module(to_input(x, ds.mean, ds.std, dtype)), y)
            opt.zero_grad()
            loss.backward()
            opt.step(loss=loss)                        # every L-th: the outer update and the one allreduce
        with opt.reference(), torch.no_grad():         # the reference's weights in model, then the replica's
            model.eval()
            x = to_input(ds.test_x, ds.mean, ds.std, dtype)
            acc = (model(x).argmax(1) == ds.test_y).double().mean().item()
            model.train()
        if rank == 0:
            print(f"epoch {epoch + 1}: reference test accuracy {acc:.4f}", flush=True)
    ref = opt.reference_model()                        # all ranks reach this
    if rank == 0:
        torch.save(ref.state_dict(), a.out)
    parle_hvd.shutdown()


if __name__ == "__main__":
    main()
