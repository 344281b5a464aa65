"""``moerl calibrate-lengths``: a simulation profile whose response lengths are fitted to runs' own
(:func:`moerl.simulation.fit_response_lengths`)."""

from __future__ import annotations

import argparse

from moerl.errors import MoerlError
from moerl.simulation import LENGTHS_FILE, calibrated_profile, fit_response_lengths, read_lengths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="moerl calibrate-lengths",
        description=(
            f"Fit a simulation profile's response lengths (engine.response_tokens: median, p99, and the correlation of "
            f"a prompt's responses) to the groups runs recorded in their {LENGTHS_FILE}, responses cut at their cap "
            "counted as longer than it; write the base profile with those in place, and print what they came from."
        ),
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (run.dir of the job)")
    p.add_argument("--profile", required=True, metavar="BASE.yaml", help="the profile whose other figures it keeps")
    p.add_argument("--out", required=True, metavar="NEW.yaml", help="where the new profile is written")
    args = p.parse_args(argv)
    try:
        fit = fit_response_lengths([group for run in args.run_dirs for group in read_lengths(run)])
        out = calibrated_profile(args.profile, fit, args.run_dirs, args.out)
    except MoerlError as e:
        print(f"error: {e}")
        return 2
    print(f"{fit.report()}\nwrote {out}")
    return 0
