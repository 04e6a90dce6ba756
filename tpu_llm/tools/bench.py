"""Benchmarks (`tpu-llm bench`, `make bench`): numbers for docs/benchmarks.md, never timed tests.

shakespeare_char: nanoGPT's CPU reference run (4 layers, 4 heads, width 128, context 64, batch 12,
2000 steps, lr 1e-3, dropout 0, character vocabulary) on tinyshakespeare (the copy shipped in the
package, `builtin:tinyshakespeare`). Targets on a 2-core CPU: >= 14k tokens/s and validation loss
<= 1.88 (nanoGPT's published result).

A config path that does not exist where the command runs is looked up in the checkout too
(configs/... beside tpu_llm/), so every suite runs from any working directory.

strategies: the same tiny config (configs/tiny.yaml on the embedded corpus) under every strategy
that runs off-accelerator, each in fresh processes: default, Mirrored over 2 and 4 logical CPUs,
multi_worker with 2 local workers, parameter_server with 2 workers and 1 ps. One table: tokens/s,
steps/s, losses after N steps, and for the parameter server the staleness it observed.

comm: gradient compression (bf16, PowerSGD, top-k) and local SGD / DiLoCo on the same config and steps,
next to synchronous and parameter-server training: losses, bytes sent per step, tokens/s
(docs/communication.md).

families: gpt2 against llama at matched parameter count on Shakespeare (char), configs/shakespeare_char.yaml
and configs/shakespeare_char_llama.yaml (same data, batch, schedule and steps): validation loss,
tokens/s and MFU on this machine; then `tpu-llm plan` of configs/llama_1b.yaml on v5p-16 and v6e-8
(docs/model-families.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tpu_llm import tether
from tpu_llm.config import load_config, parse_set_args, presets
from tpu_llm.data import corpora
from tpu_llm.errors import UserError

TARGET_TOKENS_PER_SEC = 14_000
TARGET_VAL_LOSS = 1.88
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where tpu_llm/ is


def config_path(config: str) -> str:
    """`config` as given if it exists, else the preset of its file's name (configs/tiny.yaml: tiny), which
    the package ships, so every suite runs from any working directory."""
    if os.path.exists(config) or os.path.isabs(config):
        return config
    return presets().get(os.path.basename(config).removesuffix(".yaml"), config)


def shakespeare_char(data: str = "", steps: int = 2000, config: str = "configs/shakespeare_char.yaml",
                     run_dir: str = "", set_args=None, overrides: dict | None = None) -> dict:
    from tpu_llm.training.controller import train

    cfg = load_config(config_path(config), {**parse_set_args(set_args), **(overrides or {})})
    if data:
        cfg.data.train = str(data)
    if cfg.data.train.startswith(corpora.PREFIX):
        corpora.resolve(cfg.data.train, "benchmark data")  # the checksum, before anything runs
    elif not os.path.exists(cfg.data.train):
        raise UserError(f"benchmark data {cfg.data.train!r} not found; pass --data PATH/tinyshakespeare.txt, "
                        f"or leave --data out for the shipped copy ({corpora.PREFIX}tinyshakespeare)")
    cfg.train.steps = int(steps)
    cfg.train.decay_steps = int(steps)
    temporary = not run_dir
    cfg.run_dir = run_dir or tempfile.mkdtemp(prefix="tpu-llm-bench-")
    try:
        result = train(cfg)
    finally:
        if temporary:
            shutil.rmtree(cfg.run_dir, ignore_errors=True)

    rows = [("tokens/s", f"{result['tokens_per_sec']:,.0f}", f">= {TARGET_TOKENS_PER_SEC:,}",
             result["tokens_per_sec"] >= TARGET_TOKENS_PER_SEC),
            ("ms/step", f"{result['ms_per_step']:.1f}", "", None),
            ("MFU", f"{100 * result['mfu']:.1f}%", "", None),
            ("train loss", f"{result['train_loss']:.4f}", "", None),
            ("validation loss", f"{result['val_loss']:.4f}", f"<= {TARGET_VAL_LOSS}",
             result["val_loss"] <= TARGET_VAL_LOSS)]
    print(f"\nshakespeare_char, {cfg.train.steps} steps ({cfg.data.train})")
    print(f"| {'metric':<16} | {'value':>10} | {'target':>10} | met |")
    print(f"|{'-' * 18}|{'-' * 12}|{'-' * 12}|-----|")
    for name, value, target, met in rows:
        print(f"| {name:<16} | {value:>10} | {target:>10} | {'' if met is None else 'yes' if met else 'NO':>3} |")
    return result


# name, `tpu-llm` arguments before `train` (a launched cluster), extra train flags
STRATEGY_CASES = (
    ("default", [], ["--strategy=default"]),
    ("mirrored, 2 logical CPUs", [], ["--strategy=mirrored", "--cpu_devices=2"]),
    ("mirrored, 4 logical CPUs", [], ["--strategy=mirrored", "--cpu_devices=4"]),
    ("multi_worker, 2 workers", ["launch", "--workers", "2", "--"], []),
    ("parameter_server, 2 workers + 1 ps", ["launch", "--workers", "2", "--ps", "1", "--"], []),
)


def _run_case(name: str, prefix: list[str], config: str, steps: int, flags: list[str]) -> dict:
    """Train `config` for `steps` steps in fresh processes (`tpu-llm [prefix] train ...`); its summary."""
    run_dir = tempfile.mkdtemp(prefix="tpu-llm-bench-")
    command = [sys.executable, "-m", "tpu_llm", *prefix, "train", "--config", config_path(config), f"--run_dir={run_dir}",
               f"--train.steps={steps}", f"--train.decay_steps={steps}", f"--train.eval_every={steps}",
               f"--checkpoint.every_steps={steps}", "--sample.num_samples=0", *flags]
    print(f"bench     {name}: {' '.join(command[1:])}", flush=True)
    start = time.time()
    try:
        done = tether.run(command, capture_output=True, text=True)  # it stops (and saves) if this process is killed
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            raise UserError(f"benchmark case {name!r} failed (exit {done.returncode}): {' | '.join(tail)}")
        summary = [line for line in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
                   if line["split"] == "summary"][-1]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(f"bench     {name}: {summary['tokens_per_sec']:,.0f} tokens/s, {summary['ms_per_step']:.1f} ms/step, "
          f"val loss {summary['val_loss']:.4f}", flush=True)
    return {"case": name, "wall_seconds": time.time() - start, **summary}


def strategies(steps: int = 200, config: str = "configs/tiny.yaml", only: str = "") -> list[dict]:
    """Train `config` for `steps` steps under each strategy (fresh processes); print one table."""
    rows = [_run_case(name, prefix, config, steps, flags) for name, prefix, flags in STRATEGY_CASES
            if not only or only in name]
    print(f"\nstrategies, {config}, {steps} steps each (timing excludes the first, compiling, loop)")
    print(f"| {'strategy':<36} | {'tokens/s':>9} | {'steps/s':>7} | {'train loss':>10} | {'val loss':>8} "
          f"| {'staleness (mean/max)':>20} | {'wall s':>6} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 9}|{'-' * 12}|{'-' * 10}|{'-' * 22}|{'-' * 8}|")
    for r in rows:
        stale = f"{r['staleness']:.2f} / {r['staleness_max']:.0f}" if r.get("staleness") is not None else "0 (sync)"
        print(f"| {r['case']:<36} | {r['tokens_per_sec']:>9,.0f} | {1000 / r['ms_per_step']:>7.2f} | "
              f"{r['train_loss']:>10.4f} | {r['val_loss']:>8.4f} | {stale:>20} | {r['wall_seconds']:>6.0f} |")
    return rows


def modes(steps: int = 100, config: str = "configs/tiny.yaml") -> list[dict]:
    """Execution modes (eager / graph / xla) and precisions (float32 / mixed_bfloat16) on the CPU."""
    cases = [("xla, float32", ["--execution=xla", "--precision=float32"], steps),
             ("graph, float32", ["--execution=graph", "--precision=float32"], steps),
             ("eager, float32", ["--execution=eager", "--precision=float32"], max(4, steps // 10)),
             ("xla, mixed_bfloat16", ["--execution=xla", "--precision=mixed_bfloat16"], steps)]
    rows = [{**_run_case(name, [], config, n, flags), "steps": n} for name, flags, n in cases]
    print(f"\nexecution modes and precision, {config} on this CPU (timing excludes the first call)")
    print(f"| {'mode':<22} | {'steps':>5} | {'tokens/s':>9} | {'ms/step':>8} | {'train loss':>10} |")
    print(f"|{'-' * 24}|{'-' * 7}|{'-' * 11}|{'-' * 10}|{'-' * 12}|")
    for r in rows:
        print(f"| {r['case']:<22} | {r['steps']:>5} | {r['tokens_per_sec']:>9,.0f} | {r['ms_per_step']:>8.1f} | "
              f"{r['train_loss']:>10.4f} |")
    return rows


def pipeline_stages(steps: int = 60, config: str = "configs/tiny.yaml", stages: str = "2,4",
                    microbatches: str = "1,2,4,8,16") -> list[dict]:
    """GPipe on logical CPUs: measured step time per (P, M) next to the schedule simulator's prediction.

    The simulator gets per-stage forward times from the measured unpipelined step (a third of it is
    the forward pass, split over the stages by their FLOPs and over the micro-batches evenly), so the
    comparison tests the schedule model, not a FLOPs-to-seconds guess."""
    from tpu_llm.config import load_config
    from tpu_llm.parallel import pipeline
    from tpu_llm.tools import plan

    cfg = load_config(config_path(config), {})
    base = _run_case("P=1", [], config, steps, [])
    rows = []
    for p in (int(v) for v in str(stages).split(",")):
        parts = pipeline.partition(cfg.model, 257, cfg.data.seq_len, p)  # byte vocabulary
        total = sum(s.flops_per_token for s in parts)
        for m in (int(v) for v in str(microbatches).split(",")):
            if cfg.train.batch_size % m:
                continue
            measured = _run_case(f"P={p} M={m}", [], config, steps,
                                 [f"--cpu_devices={p}", f"--parallel.pipeline_stages={p}",
                                  f"--parallel.microbatches={m}"])
            forward = [base["ms_per_step"] / 3 * s.flops_per_token / total / m for s in parts]
            predicted, bubble, _ = plan.simulate(forward, m)
            rows.append({"P": p, "M": m, "measured": measured["ms_per_step"], "predicted": predicted,
                         "bubble": bubble, "loss": measured["train_loss"]})
    print(f"\nGPipe on logical CPUs, {config}: {steps} steps; unpipelined: {base['ms_per_step']:.1f} ms/step")
    print(f"| P | M | measured ms/step | simulated ms/step | simulated bubble | train loss |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['M']} | {r['measured']:.1f} | {r['predicted']:.1f} | {100 * r['bubble']:.0f}% | "
              f"{r['loss']:.4f} |")
    return rows


# name, `tpu-llm` arguments before `train` (a launched cluster), extra train flags. Every synchronous
# row mirrors over the same 2 logical CPUs; the async row is 2 parameter-server workers.
MIRRORED_2 = ["--strategy=mirrored", "--cpu_devices=2"]
COMM_CASES = (
    ("sync (float32 all-reduce)", [], MIRRORED_2),
    ("async (parameter server, 2 workers + 1 ps)", ["launch", "--workers", "2", "--ps", "1", "--"], []),
    ("bf16 all-reduce", [], [*MIRRORED_2, "--comm.compression=bf16"]),
    ("PowerSGD r=1", [], [*MIRRORED_2, "--comm.compression=powersgd", "--comm.rank=1"]),
    ("PowerSGD r=4", [], [*MIRRORED_2, "--comm.compression=powersgd", "--comm.rank=4"]),
    ("top-k 1%", [], [*MIRRORED_2, "--comm.compression=topk", "--comm.topk_ratio=0.01"]),
    ("local SGD H=4", [], [*MIRRORED_2, "--comm.sync_every=4"]),
    ("local SGD H=16", [], [*MIRRORED_2, "--comm.sync_every=16"]),
    ("DiLoCo H=16", [], [*MIRRORED_2, "--comm.sync_every=16", "--comm.outer_optimizer=nesterov",
                         "--comm.outer_lr=0.7", "--comm.outer_momentum=0.9"]),
)


def comm(steps: int = 100, config: str = "configs/tiny.yaml", only: str = "") -> list[dict]:
    """Gradient compression and local SGD (tpu_llm/parallel/comm.py) against synchronous and asynchronous data
    parallelism: the same config and steps in fresh processes; one table of losses, bytes per step and
    tokens/s. Bytes are what one replica (worker) sends per optimizer step: the float32 all-reduce
    payload for sync, what the compressor sends, the parameter delta / H for local SGD; for the
    parameter server a worker pushes its gradients and pulls the weights (2 x 4 bytes/parameter)."""
    rows = [_run_case(name, prefix, config, steps, flags) for name, prefix, flags in COMM_CASES
            if not only or only in name]
    for r in rows:
        dense = 4 * r["params"]
        if r.get("comm_bytes_per_step") is not None:
            r["bytes"] = r["comm_bytes_per_step"]
        else:
            r["bytes"] = 2 * dense if r["strategy"] == "parameter_server" else dense
        r["ratio"] = dense / r["bytes"]
    print(f"\ncommunication, {config}, {steps} steps each (tokens/s excludes the first, compiling, loop)")
    print(f"| {'run':<42} | {'train loss':>10} | {'val loss':>8} | {'bytes/step':>10} | {'vs fp32':>7} "
          f"| {'tokens/s':>9} |")
    print(f"|{'-' * 44}|{'-' * 12}|{'-' * 10}|{'-' * 12}|{'-' * 9}|{'-' * 11}|")
    for r in rows:
        print(f"| {r['case']:<42} | {r['train_loss']:>10.4f} | {r['val_loss']:>8.4f} | {r['bytes']:>10,.0f} "
              f"| {r['ratio']:>6.1f}x | {r['tokens_per_sec']:>9,.0f} |")
    return rows


FAMILY_CONFIGS = (("gpt2", "configs/shakespeare_char.yaml"), ("llama", "configs/shakespeare_char_llama.yaml"))
PLAN_CONFIG, PLAN_ACCELERATORS = "configs/llama_1b.yaml", ("v5p-16", "v6e-8")


def families(steps: int = 2000, configs=FAMILY_CONFIGS, plan_config: str = PLAN_CONFIG,
             accelerators=PLAN_ACCELERATORS) -> dict:
    """gpt2 vs llama on the same data and budget (fresh processes), then the planner on a 1B llama."""
    from tpu_llm.tools import plan

    rows = [_run_case(name, [], config, steps, []) for name, config in configs]
    print(f"\nmodel families on Shakespeare (char), {steps} steps each (tokens/s excludes the first, compiling, loop)")
    print(f"| {'family':<7} | {'config':<38} | {'params':>9} | {'val loss':>8} | {'tokens/s':>9} | {'MFU':>6} |")
    print(f"|{'-' * 9}|{'-' * 40}|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 8}|")
    for (name, config), r in zip(configs, rows):
        print(f"| {name:<7} | {config:<38} | {r['params']:>9,} | {r['val_loss']:>8.4f} | {r['tokens_per_sec']:>9,.0f} "
              f"| {100 * r['mfu']:>5.2f}% |")
    cfg = load_config(config_path(plan_config), {})
    plans = [plan.plan(cfg, name, check=False) for name in accelerators]
    print(f"\n`tpu-llm plan --config {plan_config}` ({plan._params(cfg, plans[0].vocab):,} parameters; "
          f"{cfg.parallel.pipeline_stages} stages x {cfg.parallel.microbatches} micro-batches, remat "
          f"{'on' if cfg.parallel.remat else 'off'}, batch {cfg.train.batch_size} x {cfg.data.seq_len}; MFU {plans[0].mfu:.0%} "
          "of peak while busy assumed)")
    print(f"| {'accelerator':<11} | {'memory per chip':>15} | {'HBM':>7} | {'step':>9} | {'tokens/s':>9} |")
    print(f"|{'-' * 13}|{'-' * 17}|{'-' * 9}|{'-' * 11}|{'-' * 11}|")
    for p in plans:
        need = p.memory_needed()
        print(f"| {p.acc.name:<11} | {plan._size(need):>15} | {100 * need / p.acc.memory_bytes:>6.0f}% | "
              f"{plan._seconds(p.step_seconds):>9} | {p.tokens_per_step / p.step_seconds:>9,.0f} |")
    return {"runs": rows, "plans": plans}
# ---- memory (docs/memory.md): chunked loss and blockwise attention ---------------------------------

# name, config overrides: GPT-2 small's shape with 2 of its 12 layers and one sequence per step (XLA:CPU
# compiles the full model slowly; the other layers add the same per-block bytes), and Llama-3.2-1B's
# block shape and 128k vocabulary (configs/llama_1b.yaml) with 2 of its 16 layers
GPT2_SHAPE = {"model.n_layer": 2, "model.n_head": 12, "model.n_embd": 768, "model.vocab_size": 50304,
              "train.batch_size": 1, "precision": "float32"}
LLAMA_SHAPE = {"model.family": "llama", "model.n_layer": 2, "model.n_head": 32, "model.n_kv_head": 8,
               "model.n_embd": 2048, "model.mlp_hidden": 8192, "model.vocab_size": 128256, "model.bias": False,
               "model.rope_theta": 500000.0, "model.tie_embeddings": True, "train.batch_size": 1,
               "precision": "float32"}
MEMORY_SHAPES = [(f"gpt2_125m T={t}", {**GPT2_SHAPE, "model.max_len": t, "data.seq_len": t}) for t in (1024, 4096, 8192)] \
    + [("llama_1b T=2048", {**LLAMA_SHAPE, "model.max_len": 2048, "data.seq_len": 2048})]
LOSS_CHUNK = 256  # tokens per chunk in the speed table (train.loss_chunk)
TABLE_LOSS_CHUNK = 128  # in the memory table: 8-16 chunks of its 1-2k tokens per step
SUGGESTED_CHUNK = 1024  # plan.SUGGESTED_LOSS_CHUNK: what the planner suggests
ATTENTION_BLOCK = 128  # model.attention_block in the table (its default)
SETTINGS = [("dense", "dense", {}), ("chunked", "dense", {"train.loss_chunk": TABLE_LOSS_CHUNK}),
            ("dense", "blockwise", {"model.attention": "blockwise", "model.attention_block": ATTENTION_BLOCK}),
            ("chunked", "blockwise", {"train.loss_chunk": TABLE_LOSS_CHUNK, "model.attention": "blockwise",
                                      "model.attention_block": ATTENTION_BLOCK})]


def memory_cases() -> list[tuple[str, str, str, dict, dict]]:
    """(shape, loss, attention, overrides, the same with a 64-id vocabulary) for every row of the table."""
    return [(shape, loss, attn, {**over, **extra}, {**over, **extra, "model.vocab_size": 64})
            for shape, over in MEMORY_SHAPES for loss, attn, extra in SETTINGS]


def memory_table(only: str = "") -> list[dict]:
    """(a) XLA's buffer assignment against the planner for every row of `memory_cases` (float32, P = 1)."""
    from tpu_llm.tools import plan, xla_memory

    cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "no RAM check")
    rows, bases = [], {}
    for shape, loss, attn, over, base in memory_cases():
        if only and only not in shape:
            continue
        cfg = load_config(None, over)
        if (shape, attn) not in bases:  # the same model with a 64-id vocabulary: what the loss adds
            bases[shape, attn] = xla_memory.measure([load_config(None, base)], 64)[0]["temp"]
        xla = xla_memory.measure([cfg], cfg.model.vocab_size)[0]
        mem = plan.plan(cfg, cpu).memory[0]
        transient = mem.activations + mem.workspace
        row = {"shape": shape, "loss": loss, "attention": attn, "seq": cfg.data.seq_len, "xla_temp": xla["temp"],
               "xla_total": xla["total"], "plan_temp": transient,
               "plan_total": mem.parameters + mem.gradients + transient, "loss_share": xla["temp"] - bases[shape, attn]}
        rows.append(row)
        print(f"bench     {shape}, {loss} loss, {attn} attention: XLA temp {row['xla_temp']:,}, planner "
              f"{transient:,.0f} ({transient / row['xla_temp']:.3f})", flush=True)
    gib = plan.GIB
    print(f"\n(a) XLA:CPU buffer assignment vs `tpu-llm plan`, float32, batch 1, 2 layers (loss_chunk={TABLE_LOSS_CHUNK}, "
          f"attention_block={ATTENTION_BLOCK})")
    print("| shape | loss | attention | XLA temp GiB | planner GiB | ratio | XLA total GiB | planner GiB | ratio "
          "| loss's share GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['loss']} | {r['attention']} | {r['xla_temp'] / gib:.3f} | {r['plan_temp'] / gib:.3f} "
              f"| {r['plan_temp'] / r['xla_temp']:.3f} | {r['xla_total'] / gib:.3f} | {r['plan_total'] / gib:.3f} "
              f"| {r['plan_total'] / r['xla_total']:.3f} | {r['loss_share'] / gib:.3f} |")
    print("\nloss's share (XLA temp minus the same model's with a 64-id vocabulary), dense / chunked:")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for attn in ("dense", "blockwise"):
            pair = {r["loss"]: r["loss_share"] for r in rows if r["shape"] == shape and r["attention"] == attn}
            if len(pair) == 2:
                cut = f"{pair['dense'] / pair['chunked']:.1f}x" if pair["chunked"] >= 2**20 else \
                    "the peak is elsewhere (one block's attention backward)"
                print(f"  {shape}, {attn} attention: {pair['dense'] / gib:.3f} / {pair['chunked'] / gib:.3f} GiB: {cut}")
    print("\nXLA temp per token of sequence (GiB / 1k tokens) and its slope between lengths (bytes per added token):")
    for loss, attn, _ in SETTINGS:
        line = [r for r in rows if r["shape"].startswith("gpt2") and r["loss"] == loss and r["attention"] == attn]
        slopes = [f"{(b['xla_temp'] - a['xla_temp']) / (b['seq'] - a['seq']):,.0f}" for a, b in zip(line, line[1:])]
        print(f"  {loss} loss, {attn} attention: " + ", ".join(f"T={r['seq']}: {r['xla_temp'] / gib * 1024 / r['seq']:.3f}"
                                                              for r in line) + f"; slopes {' -> '.join(slopes)}")
    return rows


def memory_speed(steps: int = 60, rounds: int = 5) -> list[dict]:
    """(b) training-step tokens/s with each option on and off, for shakespeare_char and tiny.

    One process per config compiles the XLA micro-step (the pipeline's loss and gradients, as
    the trainer runs it) for the four cases, then times them interleaved: `rounds` rounds of `steps`
    steps per case, each case's ratio to the baseline taken within a round (median over rounds), so
    that a machine shared with other jobs slows every case alike."""
    import tensorflow as tf

    from tpu_llm.model import GPT
    from tpu_llm.tools import xla_memory

    cases = [("baseline", {}), (f"loss_chunk={LOSS_CHUNK}", {"train.loss_chunk": LOSS_CHUNK}),
             ("blockwise", {"model.attention": "blockwise"}),
             ("both", {"train.loss_chunk": LOSS_CHUNK, "model.attention": "blockwise"})]
    rows = []
    for config in ("configs/shakespeare_char.yaml", "configs/tiny.yaml"):
        fns = {}
        for name, over in cases:
            cfg = load_config(config_path(config), {**over, "model.vocab_size": 257 if "tiny" in config else 65})
            step = xla_memory.micro_step(cfg, GPT(cfg.model, cfg.model.vocab_size).build_weights())
            x = tf.random.stateless_uniform([cfg.train.batch_size, cfg.data.seq_len], [1, 2], 0, 64, tf.int32)
            fns[name] = (step, x, cfg.train.batch_size * cfg.data.seq_len)
            fns[name][0](x, x)  # compile
        seconds = {name: [] for name, _ in cases}
        for _ in range(rounds):
            for name, _ in cases:
                fn, x, _ = fns[name]
                start = time.perf_counter()
                for _ in range(steps):
                    out = fn(x, x)
                float(out[0])
                seconds[name].append(time.perf_counter() - start)
        for name, _ in cases:
            ratios = sorted(b / t for t, b in zip(seconds[name], seconds["baseline"]))
            tokens = fns[name][2] * steps / sorted(seconds[name])[rounds // 2]
            rows.append({"config": config, "case": name, "tokens_per_sec": tokens, "ratio": ratios[rounds // 2]})
            print(f"bench     {config} {name}: {tokens:,.0f} tokens/s, {ratios[rounds // 2]:.3f} x baseline", flush=True)
    print(f"\n(b) training-step (loss and gradients) tokens/s on this machine, {rounds} interleaved rounds of "
          f"{steps} steps (medians)")
    print("| config | option | tokens/s | vs baseline |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['case']} | {r['tokens_per_sec']:,.0f} | {r['ratio']:.3f} |")
    return rows


LONGEST_TARGETS = ("v5litepod-8", "v5p-16", "v6e-8")
# a Llama-3.2-1B-like shape in the gpt2 family, for when configs/llama_1b.yaml (the llama family) is absent
LLAMA_1B_STANDIN = {"model.n_layer": 16, "model.n_head": 32, "model.n_embd": 2048, "model.vocab_size": 128256,
                    "model.bias": False}


def longest_context(limit: int = 1 << 20) -> list[dict]:
    """(c) the longest sequence the planner fits (90% of HBM, one sequence per micro-batch of each replica,
    remat on, the config's pipeline and tensor layout), before
    (dense loss and attention) and after (train.loss_chunk and blockwise attention)."""
    from tpu_llm.errors import UserError
    from tpu_llm.tools import plan

    llama = config_path("configs/llama_1b.yaml")
    try:
        load_config(llama)
        models = [("gpt2_125m", config_path("configs/gpt2_125m.yaml"), {}), ("llama_1b", llama, {})]
    except UserError:  # not in this checkout, or a family this checkout lacks
        models = [("gpt2_125m", config_path("configs/gpt2_125m.yaml"), {}),
                  ("llama-1B-like (gpt2 family)", config_path("configs/gpt2_125m.yaml"), LLAMA_1B_STANDIN)]
    after = {"train.loss_chunk": SUGGESTED_CHUNK, "model.attention": "blockwise"}
    rows = []
    for name, path, over in models:
        for target in LONGEST_TARGETS:
            acc = plan.accelerator(target)
            found = {}
            for label, extra in (("before", {}), ("after", after)):
                base = load_config(path, over).parallel
                # one sequence per micro-batch of each replica (a replica spans stages x tensor chips)
                batch = max(1, acc.chips // (base.pipeline_stages * base.tensor)) * base.microbatches

                def fits(seq, batch=batch):
                    cfg = load_config(path, {**over, **extra, "model.max_len": seq, "data.seq_len": seq,
                                             "train.batch_size": batch, "train.grad_accum": 1,
                                             "parallel.remat": True, "model.dropout": 0.0})
                    return plan.plan(cfg, acc, check=False).fits(plan.TIGHT)
                low, high = 0, 128
                while high <= limit and fits(high):
                    low, high = high, high * 2
                while high - low > 128:  # to a multiple of 128
                    mid = (low + high) // 2 // 128 * 128
                    low, high = (mid, high) if fits(mid) else (low, mid)
                found[label] = low
            rows.append({"model": name, "target": target, **found})
    print(f"\n(c) longest sequence that fits (planner, 90% of HBM, one sequence per micro-batch of each replica, "
          f"remat on, the config's parallel layout); after = "
          f"train.loss_chunk={SUGGESTED_CHUNK} and model.attention=blockwise")
    print("| model | accelerator | before | after |")
    print("|---|---|---|---|")
    def shown(seq):
        return "does not fit" if not seq else f">= {limit:,}" if seq >= limit else f"{seq:,}"

    for r in rows:
        print(f"| {r['model']} | {r['target']} | {shown(r['before'])} | {shown(r['after'])} |")
    return rows


def memory(steps: int = 60, only: str = "") -> None:
    """`tpu-llm bench memory`: (a) XLA vs the planner, (b) speed, (c) the longest context (docs/memory.md)."""
    if not only or only == "xla":
        memory_table()
    if not only or only == "speed":
        memory_speed(steps)
    if not only or only == "context":
        longest_context()
# --------------------------------------------------------------------------------------------------
# data: the input pipeline against a slice's demand (issue 16; docs/data.md)

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
    import numpy as np

    from tpu_llm.data import dataset as data
    from tpu_llm.data import sources
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
        data.UNIT_TOKENS = 1 << 16
        source = sources.Source(files, "tfrecord")

        def make(start=None):
            return data.make_dataset_fn(source, _NoTokenizer(), seq, batch, training=True, seed=0,
                                        shuffle_buffer=cfg.data.shuffle_buffer, with_position=True, start=start)

        replicas = p.acc.chips  # one per chip, data parallel
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
        tokens_per_s = windows_per_s * seq
        lanes = fn.rows
        table = _table_at_step(table.numpy(), 100_000, batch // lanes)
        resume = {}
        for name, pipelines in (("same", hosts), ("changed", 2 * hosts)):
            began = time.perf_counter()
            resumed = make(start=table)
            next(iter(resumed(tf_context(pipelines, 0, replicas))))
            resume[name] = (time.perf_counter() - began, resumed.resumed)
        distinct = _diversity(work)
        rss = _streaming_rss(work, text_gb) if text_gb > 0 else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

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
    print(f"\ndata pipeline: {cfg.train.batch_size} x {seq} tokens per step, {lanes} lanes; demand of one of "
          f"{hosts} hosts on {p.acc.name} training {os.path.basename(config)} (tpu-llm plan, MFU "
          f"{100 * p.mfu:.0f}%): {demand:,.0f} tokens/s")
    print(f"| {'metric':<46} | {'value':>16} | {'target':>22} | met |")
    print(f"|{'-' * 48}|{'-' * 18}|{'-' * 24}|-----|")
    for name, value, target, met in rows:
        print(f"| {name:<46} | {value:>16} | {target:>22} | {'' if met is None else 'yes' if met else 'NO':>3} |")
    return {"windows_per_s": windows_per_s, "tokens_per_s": tokens_per_s, "demand": demand, "fresh": fresh,
            "resume": resume, "distinct": distinct, "rss": rss}


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
    from tpu_llm.data import dataset as data

    table = table.copy()
    lanes, size = int(table[0, 0]), int(table[0, 1])
    for lane in range(lanes):
        consumed = step * per_lane
        table[lane, data.FIXED:] = (consumed // size, consumed % size, lane + lanes * 40, 3, 500)
    return table


def _diversity(work: str) -> list[int]:
    """Distinct documents among each of 4 batches of 512 windows over 64 shards (every document of
    16 windows: contiguous text cannot fill a batch)."""
    from tpu_llm.data import dataset as data
    from tpu_llm.data import sources

    length, window = 256, 16
    files = _synthetic_shards(os.path.join(work, "diversity"), shards=64, tokens=64 * length, vocab=1 << 30,
                              doc_tokens=(length, length + 1))
    saved, data.UNIT_TOKENS = data.UNIT_TOKENS, 8 * length
    try:
        fn = data.make_dataset_fn(sources.Source(files, "tfrecord"), _NoTokenizer(), window - 1, 512, training=True,
                                  seed=0, shuffle_buffer=1024)
        return [len(set(x[:, 0].tolist())) for x, _ in fn().take(4).as_numpy_iterator()]
    finally:
        data.UNIT_TOKENS = saved


def _streaming_rss(work: str, gigabytes: float) -> tuple[int, float]:
    """(peak RSS in bytes, tokens/s) of a fresh process reading a `gigabytes` GB single-line-per-100-bytes
    text file through the training reader and the byte tokenizer (`data.text_pieces`, `encode_tf`)."""
    path = os.path.join(work, "big.txt")
    line = (b"the quick brown fox jumps over the lazy dog " * 3)[:99] + b"\n"
    block = line * (1 << 14)
    with open(path, "wb") as f:
        for _ in range(int(gigabytes * 2**30) // len(block)):
            f.write(block)
    script = (
        "import resource, sys, time\n"
        "import tensorflow as tf\n"
        "from tpu_llm.data import dataset as data\n"
        "from tpu_llm.tokenizers import ByteTokenizer\n"
        "tok, n, t = ByteTokenizer(), 0, time.perf_counter()\n"
        "pieces = data.text_pieces(sys.argv[1]).map(lambda p: tf.size(tok.encode_tf(p[None]).flat_values),\n"
        "                                           num_parallel_calls=4)\n"
        "for k in pieces.prefetch(4).as_numpy_iterator():\n"
        "    n += int(k)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, n / (time.perf_counter() - t))\n")
    env = {**os.environ, "PYTHONPATH": CHECKOUT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, env=env, check=True)
    rss, rate = out.stdout.split()[-2:]
    os.remove(path)
    return int(rss), float(rate)
