#!/usr/bin/env python3
"""The suite's time table (docs/development.md#the-suites-time): test-seconds per test file and the
slowest tests, read from the JUnit XML of a pytest run.

    .venv/bin/python -m pytest -q -n 2 --dist worksteal --junitxml=suite.xml
    .venv/bin/python scripts/suite_times.py suite.xml            # files over 1% of the total, 15 slowest tests
    .venv/bin/python scripts/suite_times.py suite.xml --top 40

Test-seconds are the sum of the tests' own durations (set-up of their fixtures included), what two
xdist workers share: the wall time is about half of it when no single test dominates. Two runs are
compared on one machine at one time only: the same tree took 4,555 and 5,800 test-seconds on two days.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def durations(path: str) -> list[tuple[float, str, str]]:
    """(seconds, test file, test name) of every test case in the JUnit XML file."""
    return [(float(case.get("time", 0)), case.get("classname", "").split(".")[-1], case.get("name", ""))
            for case in ET.parse(path).iter("testcase")]


def table(cases: list[tuple[float, str, str]], top: int) -> list[str]:
    total = sum(seconds for seconds, _, _ in cases) or 1.0
    per_file = collections.Counter()
    for seconds, module, _ in cases:
        per_file[module] += seconds
    lines = [f"{len(cases)} tests, {total:,.0f} test-seconds", "", "| test file | test-seconds | share |",
             "|---|---:|---:|"]
    shown = [(module, s) for module, s in per_file.most_common() if s >= 0.01 * total]
    lines += [f"| {module} | {s:,.0f} | {100 * s / total:.0f}% |" for module, s in shown]
    rest = total - sum(s for _, s in shown)
    lines += [f"| other files ({len(per_file) - len(shown)}) | {rest:,.0f} | {100 * rest / total:.0f}% |", "",
              "| slowest tests | seconds |", "|---|---:|"]
    lines += [f"| {module}::{name} | {seconds:.0f} |" for seconds, module, name in sorted(cases, reverse=True)[:top]]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", help="the file pytest's --junitxml wrote")
    parser.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    print("\n".join(table(durations(args.junit_xml), args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
