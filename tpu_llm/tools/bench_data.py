"""`tpu-llm bench data` (issue 16; docs/data.md): one host's input pipeline against a slice's demand as
`tpu-llm plan` predicts it, on gpt2_125m-shaped shards of synthetic tokens: throughput, the time to the
first batch resumed deep into a run (on the same and on twice the pipelines), peak memory streaming a
large text file, and distinct documents per batch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tpu_llm.config import load_config
from tpu_llm.tools.bench import CHECKOUT, config_path, print_targets

CHIPS_PER_HOST = 4  # v4 / v5p hosts: a v5p-16 (8 chips) is 2 hosts, each running one input pipeline
DATA_TARGET_RATIO = 10  # one host's pipeline: at least 10x that host's demand
DATA_TARGET_RESUME_SECONDS = 5.0
DATA_TARGET_RSS_GB = 2.0


def data_pipeline(accelerator: str = "v5p-16", config: str = "configs/gpt2_125m.yaml", text_gb: float = 3.0,
                  steps: int = 20) -> dict:
    """Throughput of one host's training pipeline on gpt2_125m-shaped shards (synthetic tokens) against
    that host's demand as `tpu-llm plan` predicts it; time to the first batch resumed at step 100,000
    with the same and with twice the pipelines; peak RSS streaming a `text_gb` GB text file through the
    reader and tokenizer in a fresh process; distinct documents per batch of 512."""
    from tpu_llm.data import dataset as data
    from tpu_llm.data import reading, sources
    from tpu_llm.tools import plan

    cfg = load_config(config_path(config))
    cfg.model.vocab_size = cfg.model.vocab_size or plan.ASSUMED_SENTENCEPIECE_VOCAB
    p = plan.plan(cfg, accelerator, check=False)
    hosts = max(1, p.acc.chips // CHIPS_PER_HOST)
    demand = p.tokens_per_step / p.step_seconds / hosts  # tokens/s one host's pipeline must deliver
    work = tempfile.mkdtemp(prefix="tpu-llm-bench-data-")
    try:
        seq, batch = cfg.data.seq_len, cfg.train.batch_size
        # 32 shards of 512k tokens in documents of 1-8k tokens; parts of 64k tokens (scaled down with the
        # data, so that the lanes are those of a real corpus: 256 of them for batch 256)
        files = _synthetic_shards(os.path.join(work, "shards"), shards=32, tokens=1 << 19, vocab=50_000)
        reading.UNIT_TOKENS = 1 << 16
        source = sources.Source(files, "tfrecord")

        def make(start=None):
            return data.make_dataset_fn(source, _NoTokenizer(), seq, batch, training=True, seed=0,
                                        shuffle_buffer=cfg.data.shuffle_buffer, with_position=True, start=start)

        speed = _throughput_and_resume(make, hosts, p.acc.chips, steps, batch, seq)
        distinct = _diversity(work)
        rss = _streaming_rss(work, text_gb) if text_gb > 0 else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = _data_rows(hosts, demand, speed["windows_per_s"], speed["tokens_per_s"], speed["fresh"], speed["resume"],
                      distinct, rss, text_gb)
    print(f"\ndata pipeline: {cfg.train.batch_size} x {seq} tokens per step, {speed['lanes']} lanes; demand of one "
          f"of {hosts} hosts on {p.acc.name} training {os.path.basename(config)} (tpu-llm plan, MFU "
          f"{100 * p.mfu:.0f}%): {demand:,.0f} tokens/s")
    print_targets(rows, (46, 16, 22))
    return {"windows_per_s": speed["windows_per_s"], "tokens_per_s": speed["tokens_per_s"], "demand": demand,
            "fresh": speed["fresh"], "resume": speed["resume"], "distinct": distinct, "rss": rss}


def _throughput_and_resume(make, hosts: int, replicas: int, steps: int, batch: int, seq: int) -> dict:
    """One host's pipeline (`make(start)` builds it) with `replicas` data-parallel replicas, one per chip:
    the time to its first batch, windows/s and tokens/s over `steps` steps after a warm-up, its lanes, and
    the time to the first batch resumed at step 100,000 on `hosts` and on twice the pipelines."""
    context = tf_context(hosts, 0, replicas)
    began = time.perf_counter()
    fn = make()
    it = iter(fn(context))
    table = next(it)[2]
    fresh = time.perf_counter() - began  # to the first batch: open the files, fill the lanes' chunks
    for _ in range(replicas // hosts * 2 - 1):  # warm up
        table = next(it)[2]
    began = time.perf_counter()
    elements = replicas // hosts * steps
    for _ in range(elements):
        next(it)
    seconds = time.perf_counter() - began
    windows_per_s = steps * batch / hosts / seconds
    lanes = fn.rows
    table = _table_at_step(table.numpy(), 100_000, batch // lanes)
    resume = {}
    for name, pipelines in (("same", hosts), ("changed", 2 * hosts)):
        began = time.perf_counter()
        resumed = make(start=table)
        next(iter(resumed(tf_context(pipelines, 0, replicas))))
        resume[name] = (time.perf_counter() - began, resumed.resumed)
    return {"windows_per_s": windows_per_s, "tokens_per_s": windows_per_s * seq, "fresh": fresh, "lanes": lanes,
            "resume": resume}


def _data_rows(hosts: int, demand: float, windows_per_s: float, tokens_per_s: float, fresh: float, resume: dict,
               distinct: list[int], rss: tuple[int, float] | None, text_gb: float) -> list[tuple]:
    """The data table's rows: (metric, value, target, whether it is met: None without a target)."""
    import numpy as np

    rows = [("windows/s, one host's pipeline", f"{windows_per_s:,.0f}", "", None),
            ("tokens/s, one host's pipeline", f"{tokens_per_s:,.0f}",
             f">= {DATA_TARGET_RATIO} x {demand:,.0f}", tokens_per_s >= DATA_TARGET_RATIO * demand),
            ("first batch of a fresh start (for comparison)", f"{fresh:.2f} s", "", None),
            (f"resume at step 100,000, {hosts} pipelines", f"{resume['same'][0]:.2f} s",
             f"< {DATA_TARGET_RESUME_SECONDS:g} s", resume["same"][0] < DATA_TARGET_RESUME_SECONDS),
            (f"resume at step 100,000, {hosts} -> {2 * hosts} pipelines", f"{resume['changed'][0]:.2f} s",
             f"< {DATA_TARGET_RESUME_SECONDS:g} s", resume["changed"][0] < DATA_TARGET_RESUME_SECONDS),
            ("distinct documents per batch of 512", f"{np.mean(distinct):.0f} ({min(distinct)} min)", ">= 256",
             min(distinct) >= 256)]
    if rss is not None:
        rows.append((f"peak RSS streaming a {text_gb:g} GB text file", f"{rss[0] / 2**30:.2f} GB",
                     f"< {DATA_TARGET_RSS_GB:g} GB", rss[0] < DATA_TARGET_RSS_GB * 2**30))
        rows.append(("  its tokens/s (byte tokenizer, reader alone)", f"{rss[1]:,.0f}", "", None))
    return rows


def tf_context(pipelines: int, index: int, replicas: int):
    import tensorflow as tf

    return tf.distribute.InputContext(pipelines, index, replicas)


class _NoTokenizer:
    """Shards hold token ids: the pipeline only needs the end-of-text id."""
    eos_id = 0


def _synthetic_shards(directory: str, shards: int, tokens: int, vocab: int, doc_tokens=(1024, 8192),
                      seed: int = 0) -> list[str]:
    """`shards` TFRecord shards of `tokens` tokens each, in documents of `doc_tokens` [lo, hi) tokens
    (every token of document d is d % vocab + 1, so a window names its document), with their meta.json."""
    import numpy as np
    import tensorflow as tf

    from tpu_llm.data import sources

    os.makedirs(directory)
    rng, doc, names, meta = np.random.default_rng(seed), 0, [], {"shard_records": {}, "shard_tokens": {}}
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.tfrecord"
        left, records = tokens, 0
        with tf.io.TFRecordWriter(os.path.join(directory, name)) as writer:
            while left:
                n = min(left, int(rng.integers(*doc_tokens)))
                doc += 1
                feature = tf.train.Feature(int64_list=tf.train.Int64List(value=[doc % vocab + 1] * n))
                writer.write(tf.train.Example(features=tf.train.Features(
                    feature={sources.TFRECORD_FEATURE: feature})).SerializeToString())
                left, records = left - n, records + 1
        meta["shard_records"][name], meta["shard_tokens"][name] = records, tokens
        names.append(os.path.join(directory, name))
    with open(os.path.join(directory, "meta.json"), "w") as f:
        json.dump(meta, f)
    return names


def _table_at_step(table, step: int, per_lane: int):
    """A position table as a run would save it after `step` steps: every lane `step * per_lane` windows
    in (its chunk number and windows taken of it), deep in a later epoch (slot), in the middle of a part."""
    from tpu_llm.data import lanes as stream

    table = table.copy()
    lanes, size = int(table[0, 0]), int(table[0, 1])
    for lane in range(lanes):
        consumed = step * per_lane
        table[lane, stream.FIXED:] = (consumed // size, consumed % size, lane + lanes * 40, 3, 500)
    return table


def _diversity(work: str) -> list[int]:
    """Distinct documents among each of 4 batches of 512 windows over 64 shards (every document of
    16 windows: contiguous text cannot fill a batch)."""
    from tpu_llm.data import dataset as data
    from tpu_llm.data import reading, sources

    length, window = 256, 16
    files = _synthetic_shards(os.path.join(work, "diversity"), shards=64, tokens=64 * length, vocab=1 << 30,
                              doc_tokens=(length, length + 1))
    saved, reading.UNIT_TOKENS = reading.UNIT_TOKENS, 8 * length
    try:
        fn = data.make_dataset_fn(sources.Source(files, "tfrecord"), _NoTokenizer(), window - 1, 512, training=True,
                                  seed=0, shuffle_buffer=1024)
        return [len(set(x[:, 0].tolist())) for x, _ in fn().take(4).as_numpy_iterator()]
    finally:
        reading.UNIT_TOKENS = saved


def _streaming_rss(work: str, gigabytes: float) -> tuple[int, float]:
    """(peak RSS in bytes, tokens/s) of a fresh process reading a `gigabytes` GB single-line-per-100-bytes
    text file through the training reader and the byte tokenizer (`reading.text_pieces`, `encode_tf`)."""
    path = os.path.join(work, "big.txt")
    line = (b"the quick brown fox jumps over the lazy dog " * 3)[:99] + b"\n"
    block = line * (1 << 14)
    with open(path, "wb") as f:
        for _ in range(int(gigabytes * 2**30) // len(block)):
            f.write(block)
    script = (
        "import resource, sys, time\n"
        "import tensorflow as tf\n"
        "from tpu_llm.data import reading\n"
        "from tpu_llm.tokenizers import ByteTokenizer\n"
        "tok, n, t = ByteTokenizer(), 0, time.perf_counter()\n"
        "pieces = reading.text_pieces(sys.argv[1]).map(lambda p: tf.size(tok.encode_tf(p[None]).flat_values),\n"
        "                                              num_parallel_calls=4)\n"
        "for k in pieces.prefetch(4).as_numpy_iterator():\n"
        "    n += int(k)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, n / (time.perf_counter() - t))\n")
    env = {**os.environ, "PYTHONPATH": CHECKOUT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, env=env, check=True)
    rss, rate = out.stdout.split()[-2:]
    os.remove(path)
    return int(rss), float(rate)
