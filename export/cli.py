"""`vitserve export`: argument parsing only; torch and onnx load when the command runs."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from vitserve.help_format import DefaultsHelpFormatter
from vitserve.machine import has_int8_dot_product
from vitserve.model.config import FASHION_MNIST_DIR


def _bounded(kind, low, high, name: str):
    """An argparse type: `kind(text)` within [low, high] (argparse names `name` in its one-line error)."""
    def parse(text: str):
        value = kind(text)
        if not low <= value <= high:
            raise ValueError(text)
        return value
    parse.__name__ = name
    return parse


fraction = _bounded(float, 0.0, 1.0, "fraction (0-1)")
percentage_points = _bounded(float, 0.0, 100.0, "percentage points (0-100)")
positive_count = _bounded(int, 1, 10**9, "positive integer")
non_negative_count = _bounded(int, 0, 10**6, "integer from 0")


# What a file exported without a labelled set serves, in one line: the bundled model.onnx was exported with one
NO_EVAL = ("vitserve export: no --eval, so the file will serve uncalibrated softmax scores and no out-of-distribution "
           f"score (\"ood\": null); --eval DIR (a labelled set, e.g. {FASHION_MNIST_DIR}) fits both, as "
           "`make export-default` does for the bundled model")


def add_export_parser(subparsers) -> None:
    p = subparsers.add_parser("export", help="export a checkpoint to one verified ONNX file",
                              formatter_class=DefaultsHelpFormatter)
    p.add_argument("checkpoint", help="checkpoint directory (config.json + model.safetensors)")
    p.add_argument("--out", required=True, help="ONNX file to write")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp32",
                   help="fp16: float16 weights and compute, for GPUs; int8: int8 Linear weights (dynamic "
                        "quantization), for CPUs, verified by an accuracy gate against fp32 (docs/int8.md)")
    p.add_argument("--fp16", action="store_true", help="the same as --precision fp16")
    p.add_argument("--eval", dest="eval_dir", metavar="DIR",
                   help="a labelled set: Fashion-MNIST's folder (its idx files) or DIR/<label>/<image>. The file "
                        "gets a temperature fitted on half of it, so that the served probabilities are calibrated "
                        "(docs/calibration.md), and an out-of-distribution score fitted on the same half, its "
                        "threshold on the other (docs/ood.md); int8: also the gate's set (without it the gate "
                        "compares top-1 on photos only)")
    p.add_argument("--eval-limit", type=positive_count, metavar="N", help="at most N images of --eval")
    p.add_argument("--min-top1-agreement", type=fraction, default=0.99, metavar="F",
                   help="int8: the gate's least top-1 agreement with fp32 (0-1)")
    p.add_argument("--max-accuracy-drop", type=percentage_points, default=0.3, metavar="POINTS",
                   help="int8: the gate's largest accuracy loss on --eval, in percentage points")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    p.add_argument("--no-verify", action="store_true", help="skip ONNX Runtime vs PyTorch verification")
    p.add_argument("--no-relevance", action="store_true",
                   help="leave out the class-specific relevance path (a smaller file; the server then offers only "
                        "the attention rollout)")
    # export.inspection.DEFAULT_IMAGES (which imports torch, so not imported here; a test holds them equal)
    p.add_argument("--inspection-images", type=non_negative_count, default=256, metavar="N",
                   help="store the paper's Figure 7 numbers in the file (served at /v1/models/NAME/inspect), the "
                        "attention distances over N images: --inspection-dir's files, else Fashion-MNIST's test "
                        "set for a 1-channel 28x28 model, else scikit-image's photos; 0: store none")
    p.add_argument("--inspection-dir", metavar="DIR", help="image files for the attention distances")
    p.add_argument("--json", action="store_true", help="print the report as one JSON line instead of the summary")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from pathlib import Path

    from vitserve.export.accuracy_gate import EvalSetError
    from vitserve.export.calibration import CalibrationError
    from vitserve.export.onnx_export import export_onnx
    from vitserve.export.verify import ExportVerificationError
    from vitserve.model.inspection_report import InspectionInputError

    precision = "fp16" if args.fp16 else args.precision
    if args.inspection_dir is not None and not Path(args.inspection_dir).is_dir():
        print(f"vitserve export: --inspection-dir {args.inspection_dir}: not a directory", file=sys.stderr)
        return 2
    if args.eval_dir is not None and not Path(args.eval_dir).is_dir():
        print(f"vitserve export: --eval {args.eval_dir}: not a directory", file=sys.stderr)
        return 2

    started = time.perf_counter()

    def progress(text: str) -> None:
        print(f"[{time.perf_counter() - started:5.1f} s] {text}", file=sys.stderr, flush=True)

    try:
        report = export_onnx(args.checkpoint, args.out, precision=precision,
                             opset=args.opset, verify=not args.no_verify, relevance=not args.no_relevance,
                             eval_dir=args.eval_dir, eval_limit=args.eval_limit,
                             min_agreement=args.min_top1_agreement, max_accuracy_drop=args.max_accuracy_drop / 100,
                             inspection_images=args.inspection_images, inspection_dir=args.inspection_dir,
                             progress=None if args.quiet else progress)
    except ExportVerificationError as e:
        print(f"export failed verification: {e}")
        return 1
    except (EvalSetError, CalibrationError) as e:
        print(f"vitserve export: {e}", file=sys.stderr)
        return 2
    except InspectionInputError as e:
        print(f"vitserve export: --inspection-dir: {e}", file=sys.stderr)
        return 2
    summary = report_summary(report)
    print(json.dumps(summary) if args.json else human_summary(summary))
    if args.eval_dir is None:  # said at the end, beside the summary: a failed export's error stays its one line
        print(NO_EVAL, file=sys.stderr)
    advice = precision_advice(report.precision, has_int8_dot_product(), args.checkpoint)
    if advice:
        print(advice, file=sys.stderr)
    return 0


def precision_advice(precision: str, cpu_has_int8_dot_product: bool, checkpoint: str) -> str | None:
    """One line on whether int8 pays on this CPU (docs/int8.md), where it bears on the file just written."""
    if precision == "int8" and not cpu_has_int8_dot_product:
        return ("this CPU has no int8 dot-product units (AVX512-VNNI, AVX-VNNI or AMX): the int8 file will run no "
                "faster here than the float32 one, and may run slower; it pays on a CPU that has them (docs/int8.md)")
    if precision == "fp32" and cpu_has_int8_dot_product:
        return (f"this CPU multiplies int8 natively (VNNI): `vitserve export {checkpoint} --out ... --precision int8 "
                "--eval DIR` makes a file that serves about twice as fast here, if it passes its accuracy gate "
                "(docs/int8.md)")
    return None


def reliability_diagram(before: list[dict], after: list[dict]) -> str:
    """The reliability diagram as text: per confidence bin, the answers in it and their accuracy, before and
    after the temperature (a calibrated model's accuracy matches the bin's confidence)."""
    rows = ["  confidence    answers  accuracy   | after: answers  accuracy  confidence"]
    for b, a in zip(before, after):
        def cell(x):
            return "       -" if x["count"] == 0 else f"{x['count']:8d}  {x['accuracy']:7.1%}"
        conf = "" if a["count"] == 0 else f"  {a['confidence']:9.1%}"
        rows.append(f"  {b['low']:4.2f}-{b['high']:4.2f}  {cell(b)}   |      {cell(a)}{conf}")
    return "\n".join(rows)


def human_summary(summary: dict) -> str:
    """The report in a few lines, and the command that serves the file."""
    lines = [f"exported {summary['path']}: {summary['precision']}, opset {summary['opset']}, "
             f"{summary['size_bytes'] / 1e6:.1f} MB, in {summary['export_seconds']} s"]
    if "verified" in summary:
        v = summary["verified"]
        sizes = sorted({f"{h}x{w}" for h, w, _ in v["cases"]})
        lines.append(f"verified against PyTorch at {', '.join(sizes)}: logits within {v['max_logits_abs_diff']:.1e}, "
                     f"rollout within {v['max_rollout_abs_diff']:.1e}: at most {v['tolerance_used']:.0%} of the "
                     f"tolerances ({_tolerance('logit', v['tolerances']['logits'])}, "
                     f"{_tolerance('rollout', v['tolerances']['rollout'])}, per case)")
    else:
        lines.append("not verified (--no-verify)")
    if "relevance_verified" in summary:
        r = summary["relevance_verified"]
        lines.append(f"relevance path verified: within {r['max_relevance_rel_diff']:.1e} of the largest |relevance| "
                     f"(tolerance {r['tolerance']['relevance']['rtol']:g}); at most {r['tolerance_used']:.0%} of "
                     f"every tolerance")
    if "embedding_verified" in summary:
        e = summary["embedding_verified"]
        sizes = sorted({f"{h}x{w}" for h, w, _, _ in e["cases"]})
        paths = sorted({path for *_, path in e["cases"]})
        lines.append(f"embedding verified against PyTorch's class token at {', '.join(sizes)} ({' and '.join(paths)} "
                     f"path{'s' if len(paths) > 1 else ''}): within {e['max_rel_diff']:.1e} of the largest |value| "
                     f"(tolerance {e['tolerance']['rtol']:g})")
    if "fp16_vs_fp32" in summary:
        f = summary["fp16_vs_fp32"]
        lines.append(f"float16 against float32: logits within {f['max_logits_abs_diff']:.1e}, embedding within "
                     f"{f['max_embedding_abs_diff']:.1e}, top-1 agreement {f['top1_agreement']:.4f} on {f['photos']} "
                     f"photos")
    if "calibration" in summary:
        c = summary["calibration"]
        how = f"temperature {c['temperature']:.3f}" if c.get("temperature_by_entropy") is None else \
            f"a temperature per answer by its entropy (one temperature: {c['temperature']:.3f})"
        single = "" if c.get("temperature_by_entropy") is None else \
            f" (one temperature: {c['ece_single_temperature']:.2%})"
        lines.append(f"calibrated: {how} fitted on {c['fit_images']} images of {c['source']}; on the other "
                     f"{c['report_images']}: expected calibration error {c['ece_before']:.2%} -> {c['ece_after']:.2%}"
                     f"{single}, accuracy {c['accuracy']:.2%} unchanged")
        lines.append(reliability_diagram(c["bins_before"], c["bins_after"]))
    elif "uncalibrated" in summary:
        lines.append(summary["uncalibrated"])
    if "ood" in summary:
        lines.append(_ood_line(summary["ood"], summary.get("ood_verified")))
    elif "no_ood" in summary:
        lines.append(summary["no_ood"])
    if "int8_vs_fp32" in summary:
        q = summary["int8_vs_fp32"]
        accuracy = "" if q["int8_accuracy"] is None else \
            f", accuracy {q['int8_accuracy']:.2%} against {q['fp32_accuracy']:.2%}"
        lines.append(f"int8 against float32 on {q['images']} images of {q['measured_on']}: top-1 agreement "
                     f"{q['top1_agreement']:.2%}{accuracy}, rollout Spearman {q['rollout_spearman']['mean']:.4f}")
    lines.append(f"next: vitserve serve --model {summary['path']}")
    return "\n".join(lines)


def _ood_line(ood: dict, verified: dict | None) -> str:
    line = (f"out-of-distribution score: squared Mahalanobis distance to the nearest class mean (rank {ood['rank']}), "
            f"fitted on {ood['fit_images']} images of {ood['source']}; threshold {ood['threshold']:.4g}, the 99th "
            f"percentile of {ood['threshold_images']} other images' scores, {ood['false_alarm_rate']:.2%} false alarms "
            f"on {ood['check_images']} images neither saw")
    if verified:
        line += (f"; in the graph within {verified['max_rel_diff']:.1e} of NumPy's largest score (tolerance "
                 f"{verified['tolerance']['rtol']:g})")
    return line


def _tolerance(name: str, t: dict) -> str:
    return f"{name}s {t['atol']:g} + {t['rtol']:g} x max|{name}|"


def report_summary(report) -> dict:
    summary = {"path": str(report.path), "precision": report.precision, "opset": report.opset,
               "size_bytes": report.size_bytes, "export_seconds": round(report.export_seconds, 1)}
    if report.calibration:
        summary["calibration"] = report.calibration.to_json()  # with the reliability diagram's bins
    elif report.uncalibrated:
        summary["uncalibrated"] = report.uncalibrated
    if report.ood:
        summary["ood"] = report.ood.summary
    elif report.no_ood:
        summary["no_ood"] = report.no_ood
    if report.verification:
        v = report.verification
        summary["verified"] = {"cases": [[c.height, c.width, c.batch] for c in v.cases],
                               "max_logits_abs_diff": v.max_logits_diff, "max_rollout_abs_diff": v.max_rollout_diff,
                               "tolerances": {"logits": asdict(v.logits_tolerance),
                                              "rollout": asdict(v.rollout_tolerance)},
                               "tolerance_used": v.tolerance_used}
    if report.embedding:
        summary["embedding_verified"] = _output_check(report.embedding)
    if report.ood_verification:
        summary["ood_verified"] = _output_check(report.ood_verification)
    if report.relevance:
        r = report.relevance
        summary["relevance_verified"] = {"cases": [[c.height, c.width, c.batch] for c in r.cases],
                                         "max_relevance_rel_diff": r.max_relevance_rel_diff,
                                         "tolerance": {"relevance": asdict(r.relevance_tolerance)},
                                         "tolerance_used": r.tolerance_used}
    if report.fp16:
        f = report.fp16
        summary["fp16_vs_fp32"] = {"max_logits_abs_diff": f.logits_max_abs_diff, "logits_tolerance": f.logits_tolerance,
                                   "rollout_tolerance": f.rollout_tolerance,
                                   "max_rollout_abs_diff": f.rollout_max_abs_diff,
                                   "max_embedding_abs_diff": f.embedding_max_abs_diff,
                                   "embedding_tolerance": f.embedding_tolerance, "photos": f.photos,
                                   "near_ties": f.ties, "top1_agreement": f.top1_agreement}
    if report.int8:
        q = report.int8
        summary["int8_vs_fp32"] = {"measured_on": q.source, "images": q.images, "top1_agreement": q.top1_agreement,
                                   "fp32_accuracy": q.fp32_accuracy, "int8_accuracy": q.int8_accuracy,
                                   "photo_top1_agreement": q.photo_agreement, "photos": q.photos,
                                   "photo_near_ties": q.photo_ties,
                                   "rollout_spearman": {"mean": q.rollout_spearman_mean, "min": q.rollout_spearman_min},
                                   "relevance_spearman": None if q.relevance_spearman_mean is None else
                                   {"mean": q.relevance_spearman_mean, "min": q.relevance_spearman_min},
                                   "gate": q.gate}
    return summary


def _output_check(report) -> dict:
    """An output's check (export/verify.py OutputReport) as JSON: its cases [height, width, batch, path]."""
    return {"cases": [[c.height, c.width, c.batch, c.path] for c in report.cases],
            "max_rel_diff": report.max_rel_diff, "tolerance": asdict(report.tolerance),
            "tolerance_used": report.tolerance_used}
