"""parle_hvd.flatness (the paper's RQ4): filter-normalised directions and the loss rise."""
import torch
from torch import nn

from parle_hvd.flatness import filter_normalized_direction, loss_rise


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def test_each_filter_has_the_norm_of_the_weights_filter_and_1d_params_stay():
    m = _model()
    d = filter_normalized_direction(m, torch.Generator().manual_seed(1))
    for name, p in m.named_parameters():
        if p.dim() <= 1:
            assert torch.equal(d[name], torch.zeros_like(p)), name
        else:
            want = p.detach().reshape(p.shape[0], -1).norm(dim=1)
            got = d[name].reshape(p.shape[0], -1).norm(dim=1)
            assert torch.allclose(got, want, rtol=1e-5), name
    d2 = filter_normalized_direction(m, torch.Generator().manual_seed(1))
    assert all(torch.equal(d[k], d2[k]) for k in d)                 # seeded: reproducible


def test_rise_grows_with_the_size_and_weights_are_restored():
    m = _model()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 1, 6, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m.train()
    for _ in range(200):                                             # near a minimum of this batch
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    r = loss_rise(m, [(x, y)], sizes=(0.01, 0.1, 0.5), draws=6, seed=3)
    assert 0 <= r[0.01][0] < r[0.1][0] < r[0.5][0], r
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
