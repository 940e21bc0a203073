import pytest
import torch

from voxdiff.encodings import SpaceToDepth
from voxdiff.errors import ConfigError


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("factor", [2, 4])
def test_decode_is_exact_inverse(dtype, factor):
    x = torch.randn(3, 2, 4 * factor, 2 * factor, 3 * factor).to(dtype)
    enc = SpaceToDepth(factor)
    z = enc.encode(x)
    assert z.shape == (3, 2 * factor**3, 4, 2, 3)
    assert z.dtype == dtype
    assert torch.equal(enc.decode(z), x)  # bit-identical


def test_issue_shape_160x128x128():
    enc = SpaceToDepth(2)
    assert enc.encoded_shape((1, 160, 128, 128)) == (8, 80, 64, 64)
    assert enc.encode(torch.zeros(1, 1, 160, 128, 128)).shape == (1, 8, 80, 64, 64)


def test_channel_order_is_block_offset():
    # channel c*f^3 + i*f^2 + j*f + k holds x[c, d*f+i, h*f+j, w*f+k]
    x = torch.arange(2 * 4 * 4 * 4, dtype=torch.float32).reshape(1, 2, 4, 4, 4)
    z = SpaceToDepth(2).encode(x)
    for c in range(2):
        for i in range(2):
            for j in range(2):
                for k in range(2):
                    assert torch.equal(z[0, c * 8 + i * 4 + j * 2 + k], x[0, c, i::2, j::2, k::2])


@pytest.mark.parametrize("shape,axis,size", [((1, 1, 161, 128, 128), "depth", 161), ((1, 1, 8, 6, 9), "width", 9)])
def test_not_divisible_names_axis_size_factor(shape, axis, size):
    with pytest.raises(ConfigError) as err:
        SpaceToDepth(2).encode(torch.zeros(shape))
    msg = str(err.value)
    assert axis in msg and str(size) in msg and "factor 2" in msg


@pytest.mark.parametrize("factor", [0, -2, 1.5, True])
def test_bad_factor(factor):
    with pytest.raises(ConfigError, match="encoding.factor"):
        SpaceToDepth(factor)
