"""The sampling tests' power against each planted fault (issue 81), and the samples that give it.

    python benchmarks/decoding/sampling_power.py [--trials 10000] [--json]

tests/eval/test_sampling.py decodes samples of the first two generated tokens (block, DDTree: the
live embedded target, a drafter close to it, harness/sampling_faults.py) and of one block slot
on fixed logits (the slot test), and compares them with the exact distribution by Pearson's
chi-square at alpha 0.001; each planted fault (a mutation of the sampling code) must be caught.
For each test and fault this prints the fault's total variation from the exact distribution,
the samples the test decodes under it (harness/sampling_faults.py SAMPLES: the smallest on the
ladder with power >= 0.995, a margin over the simulation's error), the power there, the
smallest sample with power >= 0.99, and the power of the clean run's sample against that fault;
per test, the clean code's false-positive rate at the clean run's sample: calibrated (the test
as run) and with the asymptotic chi-square's p-value instead.

Power is computed, not decoded: each fault's exact distribution is written from the rule
(harness/sampling_faults.py `second_token`; the tests check that each planted decoder's sample
fits it), and `--trials` samples of that size are drawn from it by a multinomial and put through
the test, its p-value calibrated on 100,000 samples from the exact distribution
(harness/sampling_stats.py `calibrated_power`). Simulated rather than the noncentral chi-square:
at these sizes the rarer categories hold 5 to 20 counts, where the asymptotic distributions are
off (the false-positive column shows by how much). Deterministic (seeded); the CPU, a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from harness.sampling_faults import (GROSS, LADDER, SAMPLES, clean_samples, distributions,  # noqa: E402
                                     powered_prompt, total_variation)
from harness.sampling_stats import (calibrated_power, categories, null_statistics,  # noqa: E402
                                    simulated_power)

ALPHA = 0.001     # tests/eval/test_sampling.py's
POWER = 0.99


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000, help="simulated samples per power figure (default 10000)")
    parser.add_argument("--json", action="store_true", help="the table as JSON")
    args = parser.parse_args()
    if args.trials < 100:
        parser.error(f"--trials must be at least 100, got {args.trials}")

    from transformers import AutoTokenizer

    from pipeline import embedded
    from pipeline.data.prompts import read_prompts
    from pipeline.target_model import load_target

    model = load_target(embedded.TARGET_DIR)
    tokenizer = AutoTokenizer.from_pretrained(embedded.TARGET_DIR, local_files_only=True)
    prompt = powered_prompt([p["ids"] for p in read_prompts(embedded.HELDOUT_DATA, tokenizer, 40)])

    rows = []
    for test in ("block", "ddtree", "slot"):
        exact, faults, accepted = distributions(test, model, prompt)
        nulls = {}

        def power(dist, n, trials=args.trials, seed=0):
            cats = categories(exact, n)
            if n not in nulls:
                nulls[n] = null_statistics(exact, cats, n)
            return calibrated_power(dist, exact, cats, n, ALPHA, nulls[n], trials=trials, seed=seed)

        n = clean_samples(test)
        rows.append({"test": test, "fault": None, "acceptance": accepted, "samples": n,
                     "categories": len(categories(exact, n)) + 1,
                     "false_positive_rate": power(exact, n, 10 * args.trials, seed=1),
                     "asymptotic_false_positive_rate": simulated_power(exact, exact, categories(exact, n), n, ALPHA,
                                                                       trials=10 * args.trials, seed=1)})
        for name, dist in faults.items():
            n = SAMPLES[test][name]
            rows.append({"test": test, "fault": name, "kind": "gross" if name in GROSS else "subtle",
                         "total_variation": total_variation(dist, exact), "samples": n, "power": power(dist, n),
                         "smallest_on_ladder": next((m for m in LADDER if power(dist, m) >= POWER), None),
                         "power_at_clean_samples": power(dist, clean_samples(test))})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"alpha {ALPHA}, {args.trials:,} simulated samples per power figure "
          f"({10 * args.trials:,} for the false-positive rate)\n")
    print("| test | planted fault | kind | TV from exact | samples | power | smallest N with power >= 0.99 "
          "| power at the clean run's N |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["fault"] is None:
            print(f"| {r['test']} | none (clean code; slot 1 accepts {r['acceptance']:.2f}) | | | {r['samples']:,} "
                  f"| false positives {r['false_positive_rate']:.4f} ({r['categories']} categories; asymptotic "
                  f"chi-square: {r['asymptotic_false_positive_rate']:.4f}) | | |")
        else:
            print(f"| {r['test']} | {r['fault']} | {r['kind']} | {r['total_variation']:.4f} | {r['samples']:,} "
                  f"| {r['power']:.4f} | {r['smallest_on_ladder']} | {r['power_at_clean_samples']:.4f} |")


if __name__ == "__main__":
    main()
