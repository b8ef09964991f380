#!/usr/bin/env python3
"""What burn's matmul autotune chose for each product shape a run met, from the autotune logs
a GPU run leaves in its cache directory (cubecl writes one JSON record a shape: every candidate
with its outcome — timed, skipped as below the priority it ran, or failed — and the fastest).

    bench/gpu/autotune.py CACHE_DIR

CACHE_DIR is TRANSFORMER_LAB_CACHE_DIR (bench/gpu/check.sh's GPU_CHECK_CACHE) or anything
holding it. One line a shape: m×n×k, which operand is a transposed view, the operands' type,
the fastest candidate at its median time and rate, and how many candidates were timed,
skipped and failed. Shapes with fewer than 2²⁰ multiply-adds (decoding's) are left out unless
--all is given.
"""
import argparse
import glob
import json
import os


def records(root):
    for path in glob.glob(os.path.join(root, "**", "*matmul*.json.log"), recursive=True):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        yield path, json.loads(line)
                    except json.JSONDecodeError:
                        pass


def nanos(duration):
    return duration["secs"] * 1e9 + duration["nanos"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cache_dir")
    ap.add_argument("--all", action="store_true", help="also the small shapes of decoding")
    args = ap.parse_args()
    rows = {}
    for path, record in records(args.cache_dir):
        key = record["key"]["key"]
        d = key["definition"]
        macs = d["m"] * d["n"] * d["k"]
        if macs < 1 << 20 and not args.all:
            continue
        transposed = lambda layout: "T" if isinstance(layout, dict) and layout.get("MildlyPermuted", {}).get("transposed") else ""
        dtype = lambda e: e["Scalar"]["Float"].lower() if "Float" in e.get("Scalar", {}) else str(e)
        timed, skipped, failed = [], 0, 0
        for result in record["value"]["results"]:
            outcome = result["outcome"]
            if "Ok" in outcome:
                ok = outcome["Ok"]
                timed.append((nanos(ok["computation"]["median"]), ok["name"]))
            elif "Skip" in outcome.get("Err", {}):
                skipped += 1
            else:
                failed += 1
        timed.sort()
        backend = os.path.basename(os.path.dirname(path))
        shape = f"{d['m']}x{d['n']}x{d['k']}"
        operands = f"{transposed(d['matrix_layout_lhs']) or '-'}{transposed(d['matrix_layout_rhs']) or '-'}"
        types = f"{dtype(d['elem_lhs'])}->{dtype(d['elem_out'])}"
        if timed:
            ns, name = timed[0]
            best = f"{name} {ns / 1e3:.1f} us {2 * macs / ns / 1e3:.2f} TFLOP/s"
            runner = f"; next {timed[1][1]} {timed[1][0] / 1e3:.1f} us" if len(timed) > 1 else ""
        else:
            best, runner = "nothing timed", ""
        rows[(backend, shape, operands, types)] = (
            f"{backend:<24} {shape:>18} {operands:>3} {types:>9}  {best}{runner}"
            f" ({len(timed)} timed, {skipped} skipped, {failed} failed)"
        )
    print(f"{'autotune log':<24} {'m x n x k':>18} {'T':>3} {'types':>9}  fastest (T: operand read transposed)")
    for key in sorted(rows):
        print(rows[key])


if __name__ == "__main__":
    main()
