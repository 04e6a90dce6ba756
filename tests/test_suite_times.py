"""scripts/suite_times.py: the suite's time table in docs/development.md, read from pytest's JUnit XML."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("suite_times", ROOT / "scripts" / "suite_times.py")
suite_times = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = suite_times
_spec.loader.exec_module(suite_times)

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_slow" time="90.0"/>
<testcase classname="tests.test_a" name="test_fast" time="0.5"/>
<testcase classname="tests.test_b" name="test_mid[x]" time="9.0"/>
<testcase classname="tests.test_c" name="test_tiny" time="0.5"><skipped message="s"/></testcase>
</testsuite></testsuites>"""


def test_files_over_one_percent_are_rows_and_the_rest_one_line(tmp_path, capsys):
    (tmp_path / "suite.xml").write_text(XML)
    assert suite_times.main([str(tmp_path / "suite.xml"), "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "4 tests, 100 test-seconds"
    assert "| test_a | 90 | 90% |" in lines and "| test_b | 9 | 9% |" in lines
    assert "| other files (1) | 0 | 0% |" in lines  # test_c's half second is under 1%
    assert lines[-2:] == ["| test_a::test_slow | 90 |", "| test_b::test_mid[x] | 9 |"]
