"""Goodput accounting (training/goodput.py, `tpu-llm report`) and profiling by config (train.profile_steps).

One tiny run is SIGKILLed and resumed (`resumed`, shared by the module): a `python -m tpu_llm`-style
process held before its 4th host call (steps 5-6 done, ckpt-4 the newest checkpoint) is killed, and
the run resumes in this process with train.profile_steps=6:7. Its goodput figures must add up to the
wall time from the first process's start to the end of the second, and the two steps done twice, the
killed process's unrecorded end and the second start-up must be attributed to the restart.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tensorflow as tf
from helpers import PAUSED, TINY, tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_llm import cli
from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.training import goodput, profiler
from tpu_llm.training.controller import train

REPO = Path(__file__).resolve().parent.parent
RUN = {"train.steps": 8, "train.steps_per_loop": 2, "checkpoint.every_steps": 4, "execution": "graph"}
# seconds: the test's clock reads after the killed process started and around the return, against the
# ledger's. (The clock read before Popen is no start: Linux stamps a child's start once fork has copied
# its parent's page tables, which for a pytest worker of several GB took over 2 s under a full suite.)
TOLERANCE = 3.0  # the ledger flushes its end record after reading its time, and train() may still work after
# it (2.5 s short once on a loaded 2-core machine, 6 December 2026; where that tail goes is not yet known)
TICKS = 0.05  # a process's start read from /proc: clock ticks (10 ms) since boot, plus /proc/uptime's 10 ms

@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput")
    cfg = tiny_config(root, **RUN)  # (writes the corpus)
    flags = [f"--{key}={value}" for key, value in {**TINY, **RUN, "run_dir": cfg.run_dir,
                                                     "data.train": cfg.data.train}.items()]
    log = root / "killed.log"
    began = time.time()
    with open(log, "w") as out:
        # held before its 4th host call (steps 1-6 done, ckpt-4 saved) until it is killed
        proc = subprocess.Popen([sys.executable, "-c", PAUSED, "train", *flags], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PAUSE_AT_CALL": "4",
                                     "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    forked = goodput.process_started(proc.pid)  # the killed process's start, as the kernel stamped it
    try:
        deadline = time.time() + 300
        while "paused" not in log.read_text() and time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        assert "paused" in log.read_text(), log.read_text()[-3000:]
        time.sleep(0.5)  # the killed process's unrecorded end: at least this long
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    killed = time.time()
    lines = []
    started = time.time()
    summary = train(tiny_config(root, **RUN, **{"train.profile_steps": "6:7"}), say=lines.append)
    ended = time.time()
    return {"run_dir": Path(cfg.run_dir), "began": began, "forked": forked, "killed": killed, "started": started,
            "ended": ended,
            "lines": lines, "summary": summary, "first": log.read_text()}


def test_goodput_adds_up_to_the_wall_time_of_a_killed_and_resumed_run(resumed):
    records = goodput.read_records(str(resumed["run_dir"] / goodput.GOODPUT_FILE))
    figures = goodput.account(records)
    assert figures["processes"] == 2
    wall = resumed["ended"] - resumed["forked"]  # the killed process's start to the return of the second's train
    assert wall - TOLERANCE <= figures["total"] <= wall + TICKS, (figures, wall)
    assert sum(figures[c] for c in goodput.CATEGORIES) == pytest.approx(figures["total"], abs=1e-6)
    assert all(figures[c] >= 0 for c in goodput.CATEGORIES), figures
    # the restart: steps 5-6 done twice, the held-then-killed end (>= 0.5 s) and the second start-up
    assert figures["redone_steps"] == 2 and figures["restart_redone"] > 0, figures
    assert 0.5 <= figures["restart_unrecorded"] <= resumed["started"] - resumed["began"], figures
    assert 0 < figures["restart_startup"] <= resumed["ended"] - resumed["started"], figures
    assert figures["restart"] == pytest.approx(figures["restart_startup"] + figures["restart_redone"]
                                               + figures["restart_unrecorded"])
    # each process's own time: the first from its start to its last record, the second within its call
    first, second = [r for r in records if r["kind"] == "start"]
    assert resumed["began"] - TICKS <= first["started"] < first["t"] and first["step"] == 0
    assert second["started"] == pytest.approx(resumed["started"], abs=0.05) and second["step"] == 4
    assert records[-1]["kind"] == "end" and sum(r["kind"] == "end" for r in records) == 1  # the killed one wrote none
    assert 0 < figures["productive"] and 0 < figures["compile"] and figures["checkpoint"] > 0 < figures["evaluation"]
    assert figures["other"] < 0.2 * figures["total"], figures  # (0.8% here: logging, host work between calls)
    done = [line for line in resumed["lines"] if line.startswith("done")]
    assert len(done) == 1 and f"goodput {100 * figures['goodput']:.0f}% of" in done[0] and "restart" in done[0], done


def test_goodput_is_in_metrics_and_tensorboard(resumed):
    run_dir = resumed["run_dir"]
    logged = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    entries = {e["step"]: e for e in logged if e["split"] == "goodput"}
    assert sorted(entries) == [4, 8]  # the killed process's at its checkpoint, kept; then the resumed one's
    assert entries[4]["processes"] == 1 and entries[8]["processes"] == 2 and entries[8]["redone_steps"] == 2
    assert 0 < entries[8]["goodput"] < 1 and entries[8]["restart_seconds"] > 0
    tags = {(e.step, v.tag) for path in tf.io.gfile.glob(str(run_dir / "logs" / "goodput" / "events.*"))
            for e in tf.compat.v1.train.summary_iterator(path) for v in e.summary.value}
    assert {(8, "goodput"), (8, "restart_seconds"), (8, "productive_seconds")} <= tags


def test_report_prints_the_table_and_plots(resumed, capsys):
    run_dir = resumed["run_dir"]
    assert cli.main(["report", "--run_dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    for category in goodput.CATEGORIES:
        assert f"\n          {category} " in out, out
    assert "(2 steps)" in out and "(2 process(es))" in out and "loss      train:" in out
    try:
        import matplotlib  # noqa: F401 - the plot is drawn only where matplotlib is importable
    except ImportError:
        assert "plot      skipped: matplotlib is not installed" in out
    else:
        assert (run_dir / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(UserError, match=r"holds no goodput.jsonl and no metrics.jsonl \(no such directory\)"):
        cli.commands.report(str(run_dir / "missing"))


def test_the_profile_holds_exactly_the_host_calls_of_its_steps(resumed):
    # resumed at step 4 with profile_steps=6:7: calls 4->5 (compiles), 5->7 (traced, alone), 7->8
    from tensorboard.backend.event_processing import plugin_asset_util

    logdir = profiler.profile_dir(str(resumed["run_dir"]))
    [path] = profiler.trace_files(logdir)
    assert plugin_asset_util.ListAssets(logdir, "profile") == [Path(path).parent.name]  # the plugin's run list
    trace = profiler.read_trace(path)
    assert "/host:CPU" in trace["planes"] and trace["events"] > 100
    assert trace["host_calls"] == 1, trace
    steps = [r for r in goodput.read_records(str(resumed["run_dir"] / goodput.GOODPUT_FILE)) if r["kind"] == "steps"]
    assert [(r["from"], r["to"]) for r in steps][-3:] == [(4, 5), (5, 7), (7, 8)]
    assert any(line.startswith(f"profile   steps 6:7 traced: {path}") for line in resumed["lines"])


def test_accounting_of_hand_made_records():
    t = 1000.0
    records = [
        {"kind": "start", "started": t, "t": t + 5, "step": 0},  # 5 s start-up
        {"kind": "steps", "t": t + 9, "seconds": 4.0, "from": 0, "to": 2},  # 1 s/step steady: 2 s compile
        {"kind": "steps", "t": t + 11, "seconds": 2.0, "from": 2, "to": 4},
        {"kind": "checkpoint", "t": t + 12, "seconds": 1.0, "step": 4},
        {"kind": "steps", "t": t + 14, "seconds": 2.0, "from": 4, "to": 6},  # redone after the resume at 4
        # killed at t + 15; restarted at t + 20
        {"kind": "start", "started": t + 20, "t": t + 23, "step": 4},
        {"kind": "steps", "t": t + 26, "seconds": 3.0, "from": 4, "to": 6},  # 1 s/step from the first process
        {"kind": "steps", "t": t + 27, "seconds": 1.0, "from": 6, "to": 7},
        {"kind": "steps", "t": t + 27.5, "seconds": 0.5, "from": 5, "to": 6},  # a rollback to 5: step 6-7 again
        {"kind": "end", "t": t + 28},
    ]
    f = goodput.account(records)
    assert f["total"] == 28 and f["processes"] == 2
    assert f["startup"] == 5 and f["checkpoint"] == 1
    # first calls less their steps at the steady rate: 4 - 2 x 1 s; 3 - 2 x median(1.0, 0.5) s
    assert f["compile"] == pytest.approx(2 + 1.5)
    assert f["restart_startup"] == 3 and f["restart_unrecorded"] == 20 - 14
    # after the resume at 4, steps 5-6 of the first process (2 s); after the rollback to 5, step 6 (0.75 s of
    # the second process's first call) and step 7 (1 s)
    assert f["redone_steps"] == 2 + 2 and f["restart_redone"] == pytest.approx(2 + 0.75 + 1)
    assert f["productive"] == pytest.approx(2 + 2 + 0.75 + 0.5)  # steps 1-2, 3-4, 5, then 6 once more
    assert f["other"] == pytest.approx(0.5)  # the second process's last half second, between records
    assert sum(f[c] for c in goodput.CATEGORIES) == pytest.approx(28)


@pytest.mark.parametrize("value, message", [
    ("5", "train.profile_steps='5'; give START:END with 1 <= START <= END"),
    ("0:3", "train.profile_steps='0:3'; give START:END"),
    ("4:2", "train.profile_steps='4:2'; give START:END"),
    ("2:9", "train.profile_steps=2:9 ends after train.steps=8; give an END <= 8"),
    (620, "(in a YAML file, quote it: profile_steps: \"10:20\"; unquoted, YAML reads 10:20 as 620)"),
])
def test_bad_profile_steps_are_one_line_errors(value, message):
    with pytest.raises(UserError) as e:
        load_config(None, {"train.steps": 8, "train.profile_steps": value})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_profile_range_on_the_command_line_stays_text():
    assert load_config(None, cli.parser.parse(["train", "--train.profile_steps=10:20"])[1]["overrides"]
                       ).train.profile_steps == "10:20"


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.text(max_size=3),
                   st.lists(st.integers(), max_size=2))
RECORDS = st.lists(st.fixed_dictionaries(
    {"kind": st.sampled_from(["start", "steps", "end", *goodput.TIMED, "other"]), "t": st.floats(0, 1e4)},
    optional={k: VALUES for k in ("started", "step", "seconds", "from", "to")}), max_size=12)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(records=RECORDS, tail=st.binary(max_size=40))
def test_property_any_goodput_file_is_accounted_or_skipped_line_by_line(tmp_path_factory, records, tail):
    """goodput.jsonl is read from a run directory (copied, edited, torn by a kill): whatever its lines
    hold, reading and accounting never raise, and every category is a finite number."""
    path = tmp_path_factory.mktemp("ledger") / goodput.GOODPUT_FILE
    path.write_bytes("".join(json.dumps(r) + "\n" for r in records).encode() + tail)
    figures = goodput.account(goodput.read_records(str(path)))
    assert all(math.isfinite(figures[c]) for c in (*goodput.CATEGORIES, "total", "goodput"))
    goodput.table(figures), goodput.summary(figures), goodput.metrics(figures)


def test_remote_lines_go_out_in_batches_not_one_upload_each(monkeypatch):
    """On gs:// an append uploads the whole file again (TensorFlow's GCS filesystem): metrics.jsonl and
    goodput.jsonl lines are held and appended together at most every 60 s, at each flush (a saved
    checkpoint, the end of the run), and never after the run lost its lock. TF's ram:// filesystem stands
    in for gs:// (any path with a scheme takes the remote path)."""
    import tensorflow as tf

    from tpu_llm.training.line_log import LineLog

    now = [0.0]
    out = LineLog("ram://remote_append_test", "metrics.jsonl", every=60.0, clock=lambda: now[0])
    path = out.path
    for i in range(100):  # 100 host calls within a minute: nothing uploaded yet
        out.append(f"{i}\n")
        now[0] += 0.5
    assert out.uploads == 0 and not tf.io.gfile.exists(path)
    now[0] += 20  # the oldest line has waited a minute: the next line takes them all out
    out.append("100\n")
    assert out.uploads == 1
    out.append("101\n")
    out.flush()  # a checkpoint was saved
    assert out.uploads == 2
    with tf.io.gfile.GFile(path) as f:
        assert f.read() == "".join(f"{i}\n" for i in range(102))  # every line, in order, once
    out.flush()
    assert out.uploads == 2  # nothing pending: no upload

    def lost():
        raise RuntimeError("the lock was taken over")

    late = LineLog("ram://remote_append_test", "metrics.jsonl", check=lost)
    late.append("from a process that lost its lock\n")
    late.flush()
    with tf.io.gfile.GFile(path) as f:
        assert "lost its lock" not in f.read()


def test_a_ledger_on_a_remote_run_directory_batches_its_records(tmp_path):
    from tpu_llm.training import goodput

    ledger = goodput.Ledger("ram://ledger_test/run", started=0.0)
    ledger.start(0)  # start and end go out at once
    assert ledger.out.uploads == 1
    for i in range(50):
        ledger.steps(i, 1, 0.1)
    assert ledger.out.uploads == 1 and len(ledger.records) == 51  # held, still counted in figures
    ledger.flush()
    ledger.close()
    assert ledger.out.uploads == 3
    kinds = [r["kind"] for r in goodput.read_records(ledger.path)]
    assert kinds == ["start"] + ["steps"] * 50 + ["end"]
