import argparse
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from vitserve.evaluation import explanations as ex

PATCH_WEIGHTS = [0.4, 0.3, 0.2, 0.1]  # what each patch of a 2x2 grid adds to the linear scorer below


def linear_scorer(images):
    """A constructed 'model': the score is sum over patches of weight x mean pixel, so an all-ones image scores 1."""
    weights = torch.tensor(PATCH_WEIGHTS).reshape(2, 2).repeat_interleave(2, 0).repeat_interleave(2, 1) / 4  # (4, 4)

    def score(pixels, which):
        assert len(pixels) == len(which)
        return (pixels[:, 0] * weights).sum(dim=(1, 2)).double()

    return score


def curves_for(order, insertion, images=None):
    images = torch.ones(1, 1, 4, 4) if images is None else images
    baseline = torch.zeros_like(images)
    score = linear_scorer(images)
    which = torch.arange(len(images))
    image_scores, base_scores = score(images, which), score(baseline, which)
    ends = (base_scores, image_scores) if insertion else (image_scores, base_scores)
    return ex.perturbation_curve(score, images, baseline, torch.tensor(order), (2, 2), 2, insertion=insertion,
                                 ends=ends, chunk=1)


# --- pure math --------------------------------------------------------------------------------------------------


def test_trapezoid_auc_of_hand_made_curves():
    assert ex.trapezoid_auc([1.0, 0.5, 0.0]) == pytest.approx(0.5)
    assert ex.trapezoid_auc([0.0, 1.0, 0.0, 1.0]) == pytest.approx(0.5)  # (0/2 + 1 + 0 + 1/2) / 3
    assert ex.trapezoid_auc([1.0, 0.6, 0.3, 0.1, 0.0]) == pytest.approx(0.375)
    np.testing.assert_allclose(ex.trapezoid_auc([[1, 1, 1], [0, 0, 1]]), [1.0, 0.25])


def test_deletion_and_insertion_rank_a_perfect_order_above_the_reversed_one():
    perfect, reversed_ = [[0, 1, 2, 3]], [[3, 2, 1, 0]]
    np.testing.assert_allclose(curves_for(perfect, False), [[1.0, 0.6, 0.3, 0.1, 0.0]], atol=1e-6)
    np.testing.assert_allclose(curves_for(reversed_, False), [[1.0, 0.9, 0.7, 0.4, 0.0]], atol=1e-6)
    assert ex.trapezoid_auc(curves_for(perfect, False))[0] == pytest.approx(0.375, abs=1e-6)
    assert ex.trapezoid_auc(curves_for(reversed_, False))[0] == pytest.approx(0.625, abs=1e-6)
    # insertion puts the patches back in the same order: the perfect order now has the larger area
    np.testing.assert_allclose(curves_for(perfect, True), [[0.0, 0.4, 0.7, 0.9, 1.0]], atol=1e-6)
    assert ex.trapezoid_auc(curves_for(perfect, True))[0] == pytest.approx(0.625, abs=1e-6)
    assert ex.trapezoid_auc(curves_for(reversed_, True))[0] == pytest.approx(0.375, abs=1e-6)


def test_curves_follow_each_images_own_order_across_chunks():
    images = torch.ones(3, 1, 4, 4) * torch.tensor([1.0, 2.0, 0.5])[:, None, None, None]
    got = curves_for([[2, 0, 3, 1], [0, 1, 2, 3], [1, 3, 0, 2]], False, images)
    want = np.array([[1.0, 0.8, 0.4, 0.3, 0.0], [1.0, 0.6, 0.3, 0.1, 0.0], [1.0, 0.7, 0.6, 0.2, 0.0]])
    np.testing.assert_allclose(got, want * np.array([[1.0], [2.0], [0.5]]), atol=1e-6)


def test_patch_masks_switch_the_first_k_patches_of_the_order():
    masks = ex.patch_masks(torch.tensor([[3, 0, 2, 1]]), (2, 2), 2, torch.tensor([0, 1, 2, 4]))
    assert masks.shape == (1, 4, 1, 4, 4) and masks.dtype == torch.bool
    patches = masks[0, :, 0, ::2, ::2].int().tolist()  # one pixel per patch
    assert patches == [[[0, 0], [0, 0]], [[0, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 1], [1, 1]]]
    assert torch.equal(masks[0, 2, 0], torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]).bool())


def test_perturbed_images_deletion_ends_at_the_baseline_insertion_at_the_image():
    g = torch.Generator().manual_seed(0)
    images, baseline = torch.randn(2, 3, 4, 6, generator=g), torch.randn(2, 3, 4, 6, generator=g)
    order = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
    steps = torch.tensor([0, 6])
    deleted = ex.perturbed_images(images, baseline, order, (2, 3), 2, steps, insertion=False)
    inserted = ex.perturbed_images(images, baseline, order, (2, 3), 2, steps, insertion=True)
    assert torch.equal(deleted[:, 0], images) and torch.equal(deleted[:, 1], baseline)
    assert torch.equal(inserted[:, 0], baseline) and torch.equal(inserted[:, 1], images)


def test_spearman_on_known_arrays():
    a = np.array([[1.0, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    b = np.array([[10.0, 20, 30, 40], [4, 3, 2, 1], [1, 3, 2, 4], [1, 2, 3, 4]])
    got = ex.spearman_rows(a, b)
    np.testing.assert_allclose(got[:3], [1.0, -1.0, 0.8])  # 1 - 6 * 2 / (4 * 15)
    assert math.isnan(got[3])  # a constant map has no order
    tied = ex.spearman_rows(np.array([[1.0, 1, 2]]), np.array([[1.0, 2, 3]]))
    assert tied[0] == pytest.approx(math.sqrt(3) / 2)  # ranks (1.5, 1.5, 3) against (1, 2, 3)


def test_spearman_matches_scipy_row_by_row():
    rng = np.random.default_rng(1)
    a, b = rng.random((5, 49)), rng.random((5, 49))
    b[:, :10] = a[:, :10]
    want = [spearmanr(x, y).statistic for x, y in zip(a, b)]
    np.testing.assert_allclose(ex.spearman_rows(a, b), want, rtol=0, atol=1e-12)


def test_centre_prior_orders_patches_by_distance_to_the_centre():
    assert ex.ranking(ex.centre_prior((3, 3)).ravel()[None])[0].tolist() == [4, 1, 3, 5, 7, 0, 2, 6, 8]
    assert ex.ranking(ex.centre_prior((4, 4)).ravel()[None])[0][:4].tolist() == [5, 6, 9, 10]
    assert ex.ranking(ex.centre_prior((2, 2)).ravel()[None])[0].tolist() == [0, 1, 2, 3]  # all tied: row-major
    seven = ex.ranking(ex.centre_prior((7, 7)).ravel()[None])[0]
    assert seven[0] == 24 and seven[-4:].tolist() == [0, 6, 42, 48]
    np.testing.assert_allclose(ex.centre_prior((3, 3))[0], [-math.sqrt(2), -1, -math.sqrt(2)])


def test_ranking_puts_the_highest_score_first_and_keeps_ties_in_patch_order():
    assert ex.ranking(np.array([[1.0, 3, 3, 0], [0, 0, 0, 1]])).tolist() == [[1, 2, 0, 3], [3, 0, 1, 2]]


def test_random_scores_are_seeded():
    assert np.array_equal(ex.random_scores(3, 49, 7), ex.random_scores(3, 49, 7))
    assert not np.array_equal(ex.random_scores(3, 49, 7), ex.random_scores(3, 49, 8))


def test_pool_to_grid_averages_each_block():
    pooled = ex.pool_to_grid(np.arange(16.0).reshape(1, 4, 4), 2)
    np.testing.assert_array_equal(pooled, [[[2.5, 4.5], [10.5, 12.5]]])
    assert ex.pool_to_grid(np.ones((3, 14, 14)), 2).shape == (3, 7, 7)


def test_mean_ci_is_the_normal_approximation_and_skips_nans():
    ci = ex.mean_ci([1.0, 2.0, 3.0, float("nan"), 4.0])
    half = 1.959963984540054 * math.sqrt(5 / 3) / 2
    assert ci == pytest.approx({"mean": 2.5, "low": 2.5 - half, "high": 2.5 + half, "n": 4})


def test_normalised_entropy():
    np.testing.assert_allclose(ex.normalised_entropy(np.array([[1.0, 1, 1, 1], [0, 3, 0, 0], [1, 1, 0, 0]])),
                               [1.0, 0.0, 0.5])


def test_blur_keeps_a_constant_image_and_the_mass_of_a_point():
    flat = torch.full((1, 2, 9, 9), 0.7)
    torch.testing.assert_close(ex.blurred(flat, 2.0), flat)
    point = torch.zeros(1, 1, 15, 15)
    point[0, 0, 7, 7] = 1.0
    out = ex.blurred(point, 1.5)[0, 0]
    assert float(out.sum()) == pytest.approx(1.0, abs=1e-5)
    assert out.argmax().item() == 7 * 15 + 7 and torch.allclose(out, out.T) and out.max() < 0.1


# --- model randomisation ------------------------------------------------------------------------------------------


def randomised_names(vit, stage):
    return ex.cascade_order(vit)[:stage]


def test_cascade_order_is_the_head_then_blocks_top_down(tiny_model):
    assert ex.cascade_order(tiny_model) == ["head", "blocks.1", "blocks.0"]
    assert [ex.stage_label(ex.cascade_order(tiny_model)[:s]) for s in range(4)] == [
        "trained", "head", "head + top 1 block", "head + top 2 blocks"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_randomisation_stage_changes_exactly_the_modules_it_names(tiny_model, stage):
    from vitserve.model.checkpoint import weights_sha256

    before = weights_sha256(tiny_model.state_dict())
    trained = dict(tiny_model.named_parameters())
    randomised = dict(ex.cascade_stage(tiny_model, stage, seed=0).named_parameters())
    names = randomised_names(tiny_model, stage)
    assert weights_sha256(tiny_model.state_dict()) == before  # the trained model is left alone
    for key, value in randomised.items():
        inside = any(key.startswith(name + ".") for name in names)
        if not inside:
            assert torch.equal(value, trained[key]), key
        elif "norm" in key.split(".")[-2]:  # a LayerNorm: reset to the identity
            assert torch.equal(value, torch.ones_like(value) if key.endswith("weight") else torch.zeros_like(value))
        elif key.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), key
        else:  # a linear weight: new random values everywhere
            assert value.shape == trained[key].shape and not torch.isclose(value, trained[key]).any(), key
            bound = math.sqrt(6 / sum(value.shape))  # xavier-uniform
            assert value.abs().max() <= bound and value.std() > bound / 4, key


def test_cascade_keeps_a_modules_random_weights_at_later_stages(tiny_model):
    stages = [dict(ex.cascade_stage(tiny_model, s, seed=3).named_parameters()) for s in range(4)]
    for key in ("head.weight", "blocks.1.attn.qkv.weight", "blocks.1.mlp.fc2.weight"):
        first = 1 if key.startswith("head") else 2
        assert all(torch.equal(stages[first][key], stages[s][key]) for s in range(first, 4)), key
    other_seed = dict(ex.cascade_stage(tiny_model, 1, seed=4).named_parameters())
    assert not torch.equal(other_seed["head.weight"], stages[1]["head.weight"])


def test_trained_stage_explains_itself_exactly(tiny_model):
    pixels = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = np.array([0, 1, 2, 0, 1])
    logits, maps = ex.explain_batched(tiny_model, pixels, torch.full((5,), -1), batch_size=5)
    rows = ex.randomisation_test(tiny_model, pixels, labels, logits.argmax(1), maps, batch_size=5, seed=0)
    assert [r["stage"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["rollout"]["mean"] == pytest.approx(1.0) and rows[0]["relevance"]["mean"] == pytest.approx(1.0)
    assert rows[0]["agreement_with_trained"] == 1.0
    assert rows[1]["rollout"]["mean"] == pytest.approx(1.0)  # rollout never looks at the head
    assert rows[1]["relevance"]["mean"] < 0.99


# --- targets, report, command -------------------------------------------------------------------------------------


def stage_means(*means, half_width=0.02):
    return [{"relevance": {"mean": m, "low": m - half_width, "high": m + half_width}} for m in means]


def test_randomisation_checks_on_known_means():
    stages = stage_means(1.0, 0.45, 0.4, 0.35, 0.2)  # depth 3: half random at stage 2
    checks = ex.randomisation_checks(stages)
    assert [c["passed"] for c in checks] == [True, True, False]  # falls all the way without reaching chance
    assert checks[1]["measured"] == "never at chance" and checks[2]["measured"] == "max 0.400"
    stages[3]["relevance"]["mean"] = 0.41
    assert ex.randomisation_checks(stages)[0]["measured"].startswith("3 of 4 steps fall")


def test_randomisation_second_reading_follows_the_size_down_to_chance():
    upside_down = ex.randomisation_checks(stage_means(1.0, -0.3, -0.1, 0.01, -0.05))
    assert [c["passed"] for c in upside_down] == [False, True, True]
    assert upside_down[1]["measured"] == "at chance from stage 3"
    assert not ex.randomisation_checks(stage_means(1.0, -0.1, -0.3, 0.01, -0.05))[1]["passed"]  # grew first
    assert not ex.randomisation_checks(stage_means(1.0, -0.3, 0.0, 0.2, 0.0, half_width=0.3))[1]["passed"]


def test_report_paths_put_figures_in_a_folder_named_after_the_report(tmp_path):
    assert ex.report_paths(ex.Path("docs/explanations.md")) == (
        ex.Path("docs/explanations.md"), ex.Path("docs/explanations.json"), ex.Path("docs/explanations"))
    assert ex.report_paths(tmp_path / "r" / "run1.md")[2] == tmp_path / "r" / "run1"


def parse(argv):
    parser = argparse.ArgumentParser(prog="vitserve")
    add = parser.add_subparsers(dest="command", required=True).add_parser("evaluate")
    ex.add_explanations_command(add.add_subparsers(dest="evaluate_command", required=True))
    return parser.parse_args(["evaluate", "explanations", *argv])


def test_command_defaults_never_write_into_docs():
    args = parse(["some/checkpoint"])
    assert args.out == "build/explanations/explanations.md"
    assert (args.checkpoint, args.limit, args.batch_size, args.seed, args.blur_sigma, args.threads) == (
        "some/checkpoint", 500, 64, 0, 3.0, 0)
    assert args.data_dir == "/usr/share/datasets/fashion-mnist" and args.func is ex.run_explanations


@pytest.mark.slow
def test_command_end_to_end_on_synthetic_images(tiny_checkpoint, tmp_path, capsys):
    calls = []

    def load_images(data_dir, limit):
        calls.append((data_dir, limit))
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (limit, 3, 32, 32), dtype=torch.uint8, generator=g), torch.arange(limit) % 3

    out = tmp_path / "report" / "run.md"
    args = parse([str(tiny_checkpoint), "--limit", "6", "--batch-size", "16", "--data-dir", "nowhere",
                  "--out", str(out), "--threads", "1"])
    assert ex.run_explanations(args, load_images=load_images) == 0
    assert calls == [("nowhere", 6)]
    for name in ("curves", "randomisation", "overlays", "budgets"):
        assert (tmp_path / "report" / "run" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((tmp_path / "report" / "run.json").read_text())
    assert results["images"] == 6 and results["grid"] == [4, 4] and results["resolution"]["size"] == [64, 64]
    assert [s["label"] for s in results["randomisation"]] == ["trained", "head", "head + top 1 block",
                                                              "head + top 2 blocks"]
    curves = results["faithfulness"]["mean"]["mean_curve"]
    assert all(len(curves[m][c]) == 17 for m in ex.METHODS for c in ex.CURVES)
    assert curves["rollout"]["deletion"][0] == pytest.approx(curves["random"]["deletion"][0])  # shared ends
    assert curves["rollout"]["deletion"][-1] == pytest.approx(curves["centre"]["insertion"][0])
    auc = results["faithfulness"]["blur"]["auc"]["relevance"]["deletion"]
    assert auc["n"] == 6 and 0 <= auc["low"] <= auc["mean"] <= auc["high"] <= 1
    text = out.read_text()
    assert "| method | deletion AUC (lower better) | insertion AUC (higher better) |" in text
    assert text.count("| relevance - rollout | deletion |") == 2  # one per baseline
    assert text.count("| occlusion - rollout | deletion |") == 2
    assert "| 3 | head + top 2 blocks |" in text and "## Resolution consistency" in text
    assert "![deletion and insertion curves](run/curves.png)" in text and "weights sha256" in text
    assert f"--limit 6 --batch-size 16 --seed 0 --blur-sigma 3.0 --threads 1 --out {out}" in text
    assert [(r["grid"], r["tokens"]) for r in results["budgets"]] == [([3, 3], 9), ([2, 2], 4)]
    assert set(ex.MODEL_MAPS) <= set(results["budgets"][0]) and "## Every budget" in text
    assert "| relevance (served) |" in text and "| occlusion |" in text  # every candidate's row
    assert len(results["targets"]) == 11 and "| target (served relevance) |" in text
    printed = capsys.readouterr().out
    assert str(out) in printed and printed.count("PASS") + printed.count("FAIL") == 11


def test_the_json_is_strict_even_for_undefined_intervals():
    from vitserve.model.checkpoint import strict_json  # what write_report writes its JSON through

    assert json.dumps(strict_json({"ci": [float("nan"), float("inf")], "n": [1, 0.5]}), allow_nan=False) == \
        '{"ci": [null, null], "n": [1, 0.5]}'
