"""The ratios of measure.sh's runs: per benchmark, the median DIFF / standard ratio before and after, and the mean of
the rounds' paired after / before ratios (log scale) with a 95% t interval. Usage: python summary.py DIR"""

import glob
import json
import math
import statistics
import sys

T975 = {3: 3.182, 9: 2.262}  # t quantiles for the rounds' degrees of freedom
ratios: dict = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/*.json")):
    kind, preset, side, rnd = path.rsplit("/", 1)[1][:-5].split("-")
    row = json.load(open(path))["rows"][0]
    if kind == "decode":  # tokens/s: DIFF / standard
        ratio = row["tokens_per_s"]["diff"] / row["tokens_per_s"]["standard"]
    else:  # step seconds: standard / DIFF, so that higher is better for DIFF in both
        ratio = row["seconds"]["standard"] / row["seconds"]["diff"]
    ratios.setdefault((kind, preset, side), {})[int(rnd)] = ratio
for kind, preset in sorted({(k, p) for k, p, _ in ratios}):
    before, after = ratios[(kind, preset, "before")], ratios[(kind, preset, "after")]
    rounds = sorted(set(before) & set(after))
    logs = [math.log(after[r] / before[r]) for r in rounds]
    mean, half = statistics.mean(logs), T975[len(rounds) - 1] * statistics.stdev(logs) / math.sqrt(len(rounds))
    print(
        f"{kind} {preset}: {len(rounds)} rounds; DIFF/standard median before {statistics.median(before.values()):.3f}, "
        f"after {statistics.median(after.values()):.3f}; after/before {math.exp(mean):.3f} "
        f"(95% {math.exp(mean - half):.3f} to {math.exp(mean + half):.3f})"
    )
