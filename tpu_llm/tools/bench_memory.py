"""`tpu-llm bench memory` (docs/memory.md): the chunked loss and blockwise attention. (a) XLA's buffer
assignment against the planner's memory for GPT-2 small and Llama-3.2-1B shapes, (b) training-step speed
with each option on and off, (c) the longest sequence the planner fits on three TPU types, before and after,
(d) LoRA's trainable state, gradients and temp against full fine-tuning's, in the compiled programs,
(e) AdamW's moments whole and divided over the replicas, (f) the accumulated gradients divided too, in the
compiled TPU step (tools/bench_shard.py).
"""

from __future__ import annotations

import time

from tpu_llm.config import load_config
from tpu_llm.errors import UserError
from tpu_llm.model import families
from tpu_llm.tools.bench import config_path

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
    from tpu_llm.harness import xla_memory
    from tpu_llm.tools import plan

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


LORA_RANK = 16
LORA_SHAPES = [("tiny T=128", "configs/tiny.yaml", {"precision": "float32", "model.vocab_size": 257}),
               ("gpt2_125m T=1024", None, {**GPT2_SHAPE, "model.max_len": 1024, "data.seq_len": 1024}),
               ("llama_1b T=2048", None, {**LLAMA_SHAPE, "model.max_len": 2048, "data.seq_len": 2048})]
STATE_SEQ = 128  # the state (weights, AdamW, gradients) does not depend on the sequence: compiled short
LLAMA_1B_LAYERS = 16


def lora_cases() -> list[tuple[str, str, str | None, dict]]:
    """(shape, "full" or "LoRA", config path, overrides) of every row of the LoRA table."""
    rows = []
    for shape, path, over in LORA_SHAPES:
        every = families.get(over.get("model.family", families.DEFAULT)).peft_targets  # every projection adapted
        lora = {"train.lora_rank": LORA_RANK, "train.lora_targets": ",".join(every)}
        rows += [(shape, "full", path, over), (shape, "LoRA", path, {**over, **lora})]
    return rows


def _state_config(path, over: dict, layers: int | None = None):
    """The config with a short sequence (and `layers` blocks): for the step's state, which neither changes."""
    short = {"model.max_len": STATE_SEQ, "data.seq_len": STATE_SEQ, **({"model.n_layer": layers} if layers else {})}
    return load_config(config_path(path) if path else None, {**over, **short})


def lora_measure(only: str = "") -> list[dict]:
    """XLA's figures for every row of `lora_cases` (and Llama-3.2-1B's 1- and 2-layer programs): the micro-step's
    temp at the row's sequence, the state (`xla_memory.state`) at STATE_SEQ tokens."""
    from tpu_llm.harness import xla_memory

    measured = []
    for shape, training, path, over in lora_cases():
        if only and only not in shape:
            continue
        cfg = load_config(config_path(path) if path else None, over)
        layers = (1,) if shape.startswith("llama_1b") else ()  # and its own 2 (LLAMA_SHAPE): a block's bytes
        measured.append({"shape": shape, "training": training, "path": path, "over": over,
                         "temp": xla_memory.measure([cfg], cfg.model.vocab_size)[0]["temp"],
                         # a block's temp at the row's sequence: the 1-layer program's to this one's
                         **({"temp_1": xla_memory.measure([load_config(None, {**over, "model.n_layer": 1})],
                                                          cfg.model.vocab_size)[0]["temp"]} if layers else {}),
                         **{str(n or ""): xla_memory.measure([_state_config(path, over, n)], cfg.model.vocab_size,
                                                             state=True)[0] for n in (None, *layers)}})
        print(f"bench     {shape} {training}: {measured[-1]}", flush=True)
    return measured


def lora_table(only: str = "", measured: list[dict] | None = None) -> list[dict]:
    """(d) LoRA against full fine-tuning in the compiled programs: the trainable weights and AdamW's state
    (the whole step's parameters XLA updates in place), the gradients (the micro-step's outputs) and XLA's
    temp, each against the planner; and Llama-3.2-1B's 16 layers from its 1- and 2-layer programs: a block's
    bytes B = the difference, the rest (the table, the final norm, AdamW's step) E = the 1-layer program's
    less B; 16 layers: E + 16 B (measured per block, extrapolated: XLA:CPU compiles all 16 slowly)."""
    from tpu_llm.tools import plan

    cpu = plan.Accelerator("cpu", "CPU", 1, 1e11, 0.0, "no RAM check")
    rows, whole, blocks = [], [], []
    for m in measured if measured is not None else lora_measure(only):
        cfg = load_config(config_path(m["path"]) if m["path"] else None, m["over"])
        mem = plan.plan(cfg, cpu).memory[0]
        short = plan.plan(_state_config(m["path"], m["over"]), cpu).memory[0]  # as measured: gpt2's positions
        held = m[""]
        # the planner's AdamW state is 8 bytes per trainable parameter, the weights themselves 4 more
        rows.append({"shape": m["shape"], "training": m["training"], "state": held["trained"] + held["optimizer"],
                     "gradients": held["gradients"], "temp": m["temp"], "plan_state": short.optimizer * 3 / 2,
                     "plan_gradients": short.gradients, "plan_temp": mem.activations + mem.workspace})
        if "1" in m:
            one_layer = plan.plan(load_config(None, {**m["over"], "model.n_layer": 1}), cpu).memory[0]
            blocks.append(f"  {m['shape']}, {m['training']}: XLA {(m['temp'] - m['temp_1']) / 2**30:.3f} GiB, planner "
                          f"{(mem.activations - one_layer.activations) / 2**30:.3f} GiB")
            one, two = m["1"], m[""]  # 1 and 2 layers
            at = {k: one[k] + (LLAMA_1B_LAYERS - 1) * (two[k] - one[k]) for k in ("trained", "optimizer", "gradients")}
            mem = plan.plan(load_config(None, {**m["over"], "model.n_layer": LLAMA_1B_LAYERS}), cpu,
                            check=False).memory[0]
            whole.append({"shape": f"llama_1b, all {LLAMA_1B_LAYERS} layers: E + 16 B", "training": m["training"],
                          "state": at["trained"] + at["optimizer"], "gradients": at["gradients"],
                          "plan_state": mem.optimizer * 3 / 2, "plan_gradients": mem.gradients})
    mib, gib = 2.0**20, plan.GIB
    print(f"\n(d) LoRA (rank {LORA_RANK}; llama: all seven projections, gpt2: c_attn, c_proj, c_fc) against full "
          "fine-tuning: XLA:CPU's compiled programs vs `tpu-llm plan`, float32, one device")
    print("| shape | training | trainable + AdamW MiB | planner | ratio | gradients MiB | planner | ratio "
          "| XLA temp GiB | planner | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows + whole:
        temp = (f"{r['temp'] / gib:.3f} | {r['plan_temp'] / gib:.3f} | {r['plan_temp'] / r['temp']:.3f}"
                if "temp" in r else "- | - | -")
        print(f"| {r['shape']} | {r['training']} | {r['state'] / mib:.1f} | {r['plan_state'] / mib:.1f} "
              f"| {r['plan_state'] / r['state']:.3f} | {r['gradients'] / mib:.1f} | {r['plan_gradients'] / mib:.1f} "
              f"| {r['plan_gradients'] / r['gradients']:.3f} | {temp} |")
    if blocks:
        print("\na block's temp (the 2-layer program's less the 1-layer one's) against the planner's activations:")
        print("\n".join(blocks))
    print("\nLoRA / full fine-tuning, measured: trainable weights + AdamW state; gradients")
    for shape in dict.fromkeys(r["shape"] for r in rows + whole):
        pair = {r["training"]: r for r in rows + whole if r["shape"] == shape}
        if len(pair) == 2:
            print(f"  {shape}: {100 * pair['LoRA']['state'] / pair['full']['state']:.2f}%; "
                  f"{100 * pair['LoRA']['gradients'] / pair['full']['gradients']:.2f}%")
    return rows + whole


def memory_speed(steps: int = 60, rounds: int = 5) -> list[dict]:
    """(b) training-step tokens/s with each option on and off, for shakespeare_char and tiny.

    One process per config compiles the XLA micro-step (the pipeline's loss and gradients, as
    the trainer runs it) for the four cases, then times them interleaved: `rounds` rounds of `steps`
    steps per case, each case's ratio to the baseline taken within a round (median over rounds), so
    that a machine shared with other jobs slows every case alike."""
    import tensorflow as tf

    from tpu_llm.model import GPT
    from tpu_llm.harness import xla_memory

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
    """`tpu-llm bench memory`: (a) XLA vs the planner, (b) speed, (c) the longest context, (d) LoRA against
    full fine-tuning, (e) AdamW's moments divided over the replicas (docs/memory.md)."""
    if not only or only == "xla":
        memory_table()
    if not only or only == "speed":
        memory_speed(steps)
    if not only or only == "context":
        longest_context()
    if not only or only == "lora":
        lora_table()
    if not only or only == "shard":
        from tpu_llm.tools.bench_shard import compiled_table, shard_table
        shard_table()
        compiled_table()
