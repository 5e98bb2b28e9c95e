"""The maps measured beside the served ones: Chefer's rule against full matrix products, occlusion by hand."""
import numpy as np
import torch

from vitserve.evaluation import map_candidates
from vitserve.export.rollout_reference import numpy_relevance


def test_chefer_rule_matches_the_full_matrix_products():
    rng = np.random.default_rng(0)
    attentions = [rng.dirichlet(np.ones(5), size=(2, 3, 5)) for _ in range(4)]  # (B, heads, N, N), rows sum to 1
    gradients = [rng.standard_normal((2, 3, 5, 5)) for _ in range(4)]
    got = map_candidates.relevance_rollout([torch.from_numpy(a) for a in attentions],
                                           [torch.from_numpy(g) for g in gradients])
    np.testing.assert_allclose(got.numpy(), numpy_relevance(attentions, gradients, (2, 2)).reshape(2, 4),
                               rtol=1e-12, atol=1e-15)


def test_one_layer_chefer_relevance_is_the_weighted_class_row():
    attn = torch.tensor([[[[0.5, 0.25, 0.25], [0.2, 0.4, 0.4], [0.1, 0.1, 0.8]]]])  # (1, 1, 3, 3)
    grad = torch.tensor([[[[1.0, -2.0, 4.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]]])
    # (grad * attn)+ on the class row: [0.5, 0 (negative), 1.0]; the patches' part is [0, 1].
    assert map_candidates.relevance_rollout([attn], [grad]).tolist() == [[0.0, 1.0]]


def test_occlusion_is_the_probability_drop_per_cell(tiny_model):
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, 3, 16, 32)).astype(np.float32))
    target = torch.tensor([-1, 2])
    maps = map_candidates.occlusion(tiny_model, x, target, cells=(2, 2), batch_size=3)
    with torch.no_grad():
        probabilities = tiny_model(x).softmax(-1)
        chosen = [int(probabilities[0].argmax()), 2]
        hidden = x.clone()
        hidden[..., 8:16, 0:16] = 0  # the cell at row 1, column 0
        after = tiny_model(hidden).softmax(-1)
    for i, c in enumerate(chosen):
        assert torch.isclose(maps[i, 1, 0], probabilities[i, c] - after[i, c], atol=1e-6)
    assert maps.shape == (2, 2, 2)


def test_candidates_are_on_the_patch_grid_and_depend_on_the_class(tiny_model):
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((1, 3, 24, 40)).astype(np.float32)).expand(2, -1, -1, -1)
    for method in (map_candidates.chefer_relevance, map_candidates.gradient_input):
        maps = method(tiny_model, x, torch.tensor([0, 1]))
        assert maps.shape == (2, 3, 5)
        assert not torch.allclose(maps[0], maps[1])
