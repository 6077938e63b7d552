"""Paired t-tests of each distillation kind against the student alone, Holm–Bonferroni over all
of them (both datasets; clip-art zero-shot left out: at chance for the teacher).

The per-seed numbers are the ones `table.py` printed for the committed tables (README.md, "Per
seed"); the run directories themselves are not committed. Run: python results/distill/holm.py
"""
from scipy import stats
from statsmodels.stats.multitest import multipletests

METRICS = ("zero-shot top-1", "image→text R@1", "text→image R@1")
PER_SEED = {  # seeds 0, 1, 2: (zero-shot, image→text R@1, text→image R@1), percent
    "synthetic": {
        "alone": [(13.8, 1.4, 0.7), (11.4, 0.9, 0.9), (10.6, 0.8, 0.1)],
        "logits": [(14.2, 1.7, 1.1), (14.6, 1.3, 0.9), (9.6, 0.8, 0.6)],
        "features": [(15.4, 1.6, 1.6), (10.8, 0.6, 0.4), (12.6, 1.3, 0.8)],
        "interactive": [(17.4, 4.3, 4.5), (13.8, 4.0, 3.5), (15.0, 2.0, 2.5)],
    },
    "clipart": {
        "alone": [(5.0, 1.4, 1.2), (8.0, 1.5, 1.5), (4.1, 0.8, 1.3)],
        "logits": [(1.2, 0.6, 1.0), (9.4, 1.7, 1.2), (10.0, 0.8, 1.0)],
        "features": [(3.9, 0.6, 1.2), (7.3, 1.0, 1.0), (6.4, 1.0, 1.3)],
        "interactive": [(0.9, 3.1, 1.9), (4.6, 2.3, 1.8), (6.8, 3.1, 2.6)],
    },
}


def comparisons():
    for dataset, arms in PER_SEED.items():
        for kind in ("logits", "features", "interactive"):
            for m, metric in enumerate(METRICS):
                if dataset == "clipart" and m == 0:
                    continue
                alone = [seed[m] for seed in arms["alone"]]
                distilled = [seed[m] for seed in arms[kind]]
                difference = sum(distilled) / 3 - sum(alone) / 3
                yield (dataset, kind, metric, difference,
                       stats.ttest_rel(distilled, alone).pvalue)


def main() -> None:
    rows = list(comparisons())
    reject, holm, _, _ = multipletests([r[-1] for r in rows], method="holm")
    print(f"{len(rows)} paired comparisons (3 seeds each), Holm–Bonferroni over all of them\n")
    print("| dataset | kind | metric | Δ (points) | p | Holm p |")
    print("|---|---|---|---:|---:|---:|")
    for (dataset, kind, metric, difference, p), q in zip(rows, holm):
        print(f"| {dataset} | {kind} | {metric} | {difference:+.1f} | {p:.3f} | {q:.3f} |")
    print(f"\nsurvive: {int(reject.sum())} of {len(rows)}")


if __name__ == "__main__":
    main()
