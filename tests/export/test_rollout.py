import numpy as np
import pytest
import torch

from vitserve.export.rollout import attention_rollout, residual_attention
from vitserve.export.rollout_reference import numpy_attention_rollout


def random_attention(batch, heads, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, n, n, generator=g) * 3).softmax(-1)  # rows sum to 1, like softmax attention


def test_identity_attention_gives_zero_patch_rollout():
    eye = torch.eye(5).expand(2, 3, 5, 5)  # every token attends only to itself
    out = attention_rollout([eye, eye], (2, 2))
    assert out.shape == (2, 2, 2)
    assert torch.equal(out, torch.zeros(2, 2, 2))


def test_uniform_attention_one_layer_by_hand():
    n = 7  # 1 class token + a 2x3 grid
    uniform = torch.full((1, 2, n, n), 1 / n)
    out = attention_rollout([uniform], (2, 3))
    # class row of 0.5 * (1/n) + 0.5 * I, over the patches: 0.5 / n each
    torch.testing.assert_close(out, torch.full((1, 2, 3), 0.5 / n), rtol=0, atol=1e-7)


def test_residual_attention_rows_sum_to_one():
    a = residual_attention(random_attention(2, 4, 10, seed=0))
    torch.testing.assert_close(a.sum(-1), torch.ones(2, 10))


@pytest.mark.parametrize("depth,grid", [(1, (3, 3)), (4, (2, 5)), (6, (7, 7))])
def test_vector_rollout_equals_numpy_full_products(depth, grid):
    n = 1 + grid[0] * grid[1]
    attentions = [random_attention(3, 2, n, seed=i) for i in range(depth)]
    got = attention_rollout(attentions, grid).double().numpy()
    want = numpy_attention_rollout([a.numpy() for a in attentions], grid)
    assert got.shape == want.shape == (3, *grid)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_layer_order_matters_and_is_last_times_first():
    """R = Â_2 Â_1: the class row of the product in that order, not Â_1 Â_2."""
    a1, a2 = random_attention(1, 1, 5, seed=1), random_attention(1, 1, 5, seed=2)
    r1, r2 = residual_attention(a1)[0].double(), residual_attention(a2)[0].double()
    got = attention_rollout([a1, a2], (2, 2))[0].double()
    torch.testing.assert_close(got.flatten(), (r2 @ r1)[0, 1:], rtol=0, atol=1e-6)
    assert not torch.allclose(got.flatten(), (r1 @ r2)[0, 1:], atol=1e-4)
