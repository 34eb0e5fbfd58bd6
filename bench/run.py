"""The main job: benchmark every op family side by side with its peers, in one run, and write
bench/results/<stem>.{md,csv} plus PNG plots.

    python -m bench.run [--quick] [--families elementwise,softmax,...] [--stem NAME]
"""
import argparse
import importlib
import sys
import traceback

import torch

FAMILIES = ("elementwise", "softmax", "norm", "attention")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few representative shapes (about a minute)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset of " + ", ".join(FAMILIES))
    parser.add_argument("--stem", default=None, help="output file stem (default: report or report_quick)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench: needs a CUDA GPU; torch.cuda.is_available() is False on this machine")

    import fusedops

    from .common import Report, copy_bandwidth_gbs, copy_table, liger_state

    print(f"device: {torch.cuda.get_device_name()}; fusedops build: {fusedops.build_info()}", file=sys.stderr)
    report = Report(copy_bandwidth_gbs(), args.stem or ("report_quick" if args.quick else "report"))
    report.note = (f"fusedops build: {fusedops.build_info()}; mode: {'quick' if args.quick else 'full'}; "
                   f"{liger_state()}")
    copy_table(report)
    failed = []
    for family in args.families.split(","):
        try:
            module = importlib.import_module(f"bench.{family}")
        except ModuleNotFoundError:
            print(f"bench: no benchmarks for {family!r} yet", file=sys.stderr)
            continue
        try:
            module.run(report, args.quick)
        except Exception:  # noqa: BLE001 - one family's failure must not lose the others' numbers
            print(f"bench: {family} failed:\n{traceback.format_exc()}", file=sys.stderr)
            failed.append(family)
            report.note += f"\n\n**{family}: the benchmark failed part-way; its table is incomplete.**"
        path = report.write()  # plots after every family (the tables are saved after every case)
    print(report.markdown())
    print(f"\nwritten: {path}", file=sys.stderr)
    if failed:
        sys.exit(f"bench: {', '.join(failed)} failed part-way (see above)")


if __name__ == "__main__":
    main()
