"""Pinned parameter counts, and every model runs on its dataset's input shape."""
import pytest
import torch

from parle_hvd.models import build_model, count_params, sync_tensors


@pytest.mark.parametrize("name,kw,count,about", [
    ("lenet", dict(num_classes=10, in_channels=1, image_size=28), 132_220, None),
    ("lenet", dict(num_classes=10, in_channels=3, image_size=32), 133_220, None),
    ("allcnn", dict(num_classes=10, in_channels=3, image_size=32), 1_372_254, 1.4e6),
    ("wrn", dict(num_classes=10, in_channels=3, image_size=32, depth=28, width=10), 36_479_194, 36.5e6),
    ("wrn", dict(num_classes=100, in_channels=3, image_size=32, depth=28, width=10), 36_536_884, 36.5e6),
    ("resnet18", dict(num_classes=10, in_channels=3, image_size=32), 11_173_962, 11.2e6),
])
def test_parameter_counts(name, kw, count, about):
    m = build_model(name, **kw)
    assert count_params(m) == count
    if about:
        assert abs(count - about) / about < 0.03


@pytest.mark.parametrize("name,c,s,kw", [("lenet", 1, 28, {}), ("lenet", 3, 32, {}), ("allcnn", 3, 32, {}),
                                         ("allcnn", 1, 28, {}), ("resnet18", 3, 32, {}),
                                         ("wrn", 3, 32, dict(depth=10, width=2))])
def test_forward_shapes_and_sync_tensors(name, c, s, kw):
    m = build_model(name, num_classes=7, in_channels=c, image_size=s, **kw)
    m.train()
    out = m(torch.randn(4, c, s, s))
    assert out.shape == (4, 7)
    st = sync_tensors(m)
    assert all(t.is_floating_point() for t in st)
    bn_bufs = [b for n, b in m.named_buffers() if "running" in n]
    assert len(st) == len(list(m.parameters())) + len(bn_bufs) and len(bn_bufs) > 0


def test_default_dropouts():
    assert build_model("lenet", num_classes=10, in_channels=1).classifier[4].p == 0.25
    allcnn = build_model("allcnn", num_classes=10, in_channels=3, image_size=32)
    drops = [m.p for m in allcnn.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops == [0.2, 0.5, 0.5]
    assert [m.p for m in build_model("allcnn", num_classes=10, in_channels=3, image_size=32,
                                     dropout=0.3).modules() if isinstance(m, torch.nn.Dropout)] == [0.2, 0.3, 0.3]
