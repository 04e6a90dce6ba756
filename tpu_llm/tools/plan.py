"""Memory and step-time planner: does a config fit an accelerator, and how fast would it train there?

`tpu-llm plan --config configs/gpt2_125m.yaml --accelerator v5p-16` answers on a laptop. Everything is
arithmetic on the config; nothing is compiled.

Where. Memory is given per chip, which is one TPU device as TensorFlow sees it (v4 and v5p chips run
their two TensorCores as one megacore device; v5e and v6e chips have one). Accelerator types count
TensorCores on v4/v5p and chips on v5e (v5litepod)/v6e: v5p-16 and v4-8 are 8 and 4 chips, v5litepod-8
and v6e-8 are 8. Per chip, bf16 peak and HBM: v4 275 TFLOP/s, 32 GiB; v5e 197, 16; v5p 459, 95; v6e
918, 32. A replica spans P pipeline stages x t tensor splits chips; the slice holds R = chips / (P t)
data-parallel replicas, each with the whole model (and AdamW's moments whole, unless
parallel.shard_optimizer=state divides them over the replicas), so a chip holds one stage's share and
the most loaded stage decides. "cpu" is this machine: its measured float32 matmul peak, and
its RAM shared by all `cpu_devices` logical devices (R = cpu_devices / P, as distribute.py lays out).

The memory model is tools/plan_memory.py's (each term derived in its docstring), the time model
tools/plan_time.py's; this module puts them together (`plan`) and reports (`Plan.lines`), refusing a
config that does not fit with the smallest change that does (`Plan.check`).
"""

from __future__ import annotations

import copy
import dataclasses
import os

from tpu_llm.config import Config
from tpu_llm.config.checks import adapters_per_block
from tpu_llm.config.schema import SHARD_OPTIMIZER  # (in the order they divide more)
from tpu_llm.errors import UserError
from tpu_llm.model import spec
from tpu_llm.parallel import pipeline
from tpu_llm.tools.plan_memory import (GIB, Memory, attention_bytes, block_activation_bytes, loss_bytes, stage_memory,
                                       trainable_params)
from tpu_llm.tools.plan_time import ICI_GBPS, Accelerator, accelerator, collectives, step_time

TIGHT = 0.9  # above this share of HBM a plan is flagged (and suggestions stay below it): padding, reserve
SUGGESTED_LOSS_CHUNK = 1024  # train.loss_chunk a refusal suggests: a (1024, V) float32 tile, e.g. 0.2 GiB at V = 50k
ASSUMED_SENTENCEPIECE_VOCAB = 50304  # configs/gpt2_125m.yaml's: GPT-2's 50,257 rounded up to a multiple of 64


def vocab_size(cfg: Config) -> tuple[int, str]:
    """The vocabulary the run would have, and how it was found."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    kind, path = cfg.data.tokenizer, cfg.data.tokenizer_model
    if kind == "byte":
        return 257, "byte tokenizer"
    if kind == "sentencepiece" and path and os.path.isfile(path):
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=path).get_piece_size(), path
    if kind == "sentencepiece":
        return ASSUMED_SENTENCEPIECE_VOCAB, f"assumed: {path or 'no tokenizer model'} not readable here; " \
                                            "set model.vocab_size"
    return 256, "assumed for the char tokenizer (set model.vocab_size)"


@dataclasses.dataclass
class Plan:
    cfg: Config
    acc: Accelerator
    vocab: int
    vocab_source: str
    precision: str
    replicas: int
    micro_batch: int  # sequences per micro-batch
    stages: list[pipeline.Stage]
    memory: list[Memory]  # per stage (one chip each)
    memory_remat: list[Memory]  # the same with remat flipped, for comparison
    model_flops_per_step: float
    executed_flops_per_step: float
    mfu: float
    step_seconds: float
    bubble: float
    busy: list[float]

    @property
    def worst(self) -> int:
        return max(range(len(self.memory)), key=lambda i: self.memory[i].total)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.data.seq_len

    def memory_needed(self) -> float:
        """Bytes against `acc.memory_bytes`: one chip, or the whole machine when memory is shared."""
        if self.acc.shared_memory:
            return self.replicas * sum(mem.total for mem in self.memory)
        return self.memory[self.worst].total

    def fits(self, share: float = 1.0) -> bool:
        return not self.acc.memory_bytes or self.memory_needed() <= share * self.acc.memory_bytes

    def check(self) -> None:
        """UserError naming the largest term (and a setting that fits) when the plan does not fit."""
        if self.fits():
            return
        mem, acc = self.memory[self.worst], self.acc
        device = "logical device" if acc.shared_memory else "chip"
        where = "RAM of this machine" if acc.shared_memory else f"HBM of a {acc.kind} chip"
        state = mem.parameters + mem.optimizer + mem.gradients
        if state > acc.memory_bytes:  # the model alone overflows, whatever the batch
            raise UserError(f"parameters, optimizer and gradients: {_size(state)} per {device} (stage {self.worst}: "
                            f"{_size(mem.parameters)} + {_size(mem.optimizer)} + {_size(mem.gradients)}) > "
                            f"{_size(acc.memory_bytes)} {where} before any activation; {self._fix()}")
        name = max(("activations", "workspace"), key=lambda k: getattr(mem, k))  # what the batch adds
        others = ", ".join(f"{k} {_size(v)}" for k, v in mem.terms().items() if k != name)
        total = f"{_size(self.memory_needed())} {'on this machine' if acc.shared_memory else 'per chip'}"
        raise UserError(f"{name}: {_size(getattr(mem, name))} per {device} (stage {self.worst}); with {others} "
                        f"the total is {total} > {_size(acc.memory_bytes)} {where}; {self._fix()}")

    def _fix(self) -> str:
        """The smallest change that fits: more grad_accum, then remat, then AdamW's moments divided over the
        replicas (parallel.shard_optimizer=state, where it runs: one stage, one tensor group, 2+ replicas),
        then the accumulated gradients too (grads), then more pipeline stages; at each, first as it is, then
        with the chunked loss, then also with blockwise attention (docs/memory.md)."""
        p, t, chips = self.cfg.parallel, self.cfg.train, self.acc.chips
        stage_options = [(p.pipeline_stages, p.shard_optimizer)]
        if p.pipeline_stages == 1 and p.tensor == 1 and self.replicas > 1:  # each setting dividing more than this one
            stage_options += [(1, shard) for shard in SHARD_OPTIMIZER[SHARD_OPTIMIZER.index(p.shard_optimizer) + 1:]]
        # (pipeline stages run with whole moments: training/sharded_adamw.py divides them over replicas only)
        stage_options += [(s, "none") for s in range(p.pipeline_stages + 1, self.cfg.model.n_layer + 1)
                          if self.acc.shared_memory or chips % (s * p.tensor) == 0]
        chunk = t.loss_chunk or SUGGESTED_LOSS_CHUNK
        attention = self.cfg.model.attention if self.cfg.model.dropout else "blockwise"  # blockwise: no dropout
        memory_options = list(dict.fromkeys([(t.loss_chunk, self.cfg.model.attention),
                                             (chunk, self.cfg.model.attention), (chunk, attention)]))
        for stages, shard in stage_options:
            for remat in dict.fromkeys((p.remat, True)):
                for accum in range(t.grad_accum, t.batch_size + 1):
                    if t.batch_size % (accum * p.microbatches):
                        continue  # cannot split the batch (the rest of the check is plan's)
                    found = self._fits_with(stages, remat, accum, memory_options, shard)
                    if found is None:
                        break  # more grad_accum cannot help (it adds a gradient buffer)
                    if found:
                        return found
        return ("no grad_accum, remat, pipeline_stages, loss_chunk or attention setting fits it here: use more chips "
                "or a smaller model")

    def _fits_with(self, stages: int, remat: bool, accum: int, memory_options: list,
                   shard: str = "none") -> str | None:
        """'it fits with ...' for the first of `memory_options` (loss_chunk, attention) that fits with
        these settings, "" if none does, None if the model's state alone overflows."""
        p, t = self.cfg.parallel, self.cfg.train
        for loss_chunk, attention in memory_options:
            changes = {"train.grad_accum": accum, "parallel.remat": remat, "parallel.shard_optimizer": shard,
                       "parallel.pipeline_stages": stages, "train.loss_chunk": loss_chunk, "model.attention": attention}
            cfg = copy.deepcopy(self.cfg)
            cfg.train.grad_accum, cfg.parallel.remat, cfg.parallel.pipeline_stages = accum, remat, stages
            cfg.parallel.shard_optimizer = shard
            cfg.train.loss_chunk, cfg.model.attention = loss_chunk, attention
            if self.acc.shared_memory:
                cfg.cpu_devices = max(cfg.cpu_devices, stages) // stages * stages
                changes["cpu_devices"] = cfg.cpu_devices
            try:
                candidate = plan(cfg, self.acc, self.mfu, check=False)
            except UserError:  # the batch does not split this way
                return ""
            state = candidate.memory[candidate.worst]
            if state.parameters + state.optimizer + state.gradients > self.acc.memory_bytes:
                return None
            if candidate.fits(TIGHT):
                now = {"train.grad_accum": t.grad_accum, "parallel.remat": p.remat,
                       "parallel.shard_optimizer": p.shard_optimizer, "parallel.pipeline_stages": p.pipeline_stages, "cpu_devices": self.cfg.cpu_devices,
                       "train.loss_chunk": t.loss_chunk, "model.attention": self.cfg.model.attention}
                setting = " and ".join(f"{k}={str(v).lower()}" for k, v in changes.items() if v != now[k])
                return (f"{self._takes(changes)}it fits with {setting} ({_size(candidate.memory_needed())}, "
                        f"{_seconds(candidate.step_seconds)} per step)")
        return ""

    def _takes(self, changes: dict) -> str:
        """What the memory options of a fix remove, on the most loaded stage: "the loss's logits take
        41.0 GiB, ..." (empty when the fix uses neither)."""
        cfg, act = self.cfg, 2 if self.precision != "float32" else 4
        tokens_micro = self.micro_batch * cfg.data.seq_len
        tokens = tokens_micro * cfg.parallel.microbatches
        stage = self.stages[self.worst]
        said = []
        if changes["train.loss_chunk"] != cfg.train.loss_chunk and stage.head:
            kept, forward, backward = loss_bytes(cfg, self.vocab, tokens_micro)
            said.append(f"the loss's logits take {_size(kept * tokens + max(forward, backward))}")
        if changes["model.attention"] != cfg.model.attention:
            kept, work = attention_bytes(cfg, act)
            said.append(f"attention's scores take {_size(kept * tokens * len(stage.blocks) + work * tokens_micro)}")
        return ", ".join(said) + (": " if said else "")

    def _flops_formula(self) -> str:
        """How the model FLOPs per token are counted (spec.layer_flops_per_token)."""
        if adapters_per_block(self.cfg):
            return "4N + 6 x the adapters' + 12 L C T per token: no weight gradient for the frozen base"
        if self.cfg.train.freeze:
            return ("6N trained + 4N frozen + 12 L C T per token, only the forward below the lowest trained "
                    "layer")
        return "6N + 12 L C T per token"

    def lines(self) -> list[str]:
        """The plan as `tpu-llm plan` prints it."""
        cfg, acc, p, t = self.cfg, self.acc, self.cfg.parallel, self.cfg.train
        peak = f"{acc.peak_flops / 1e12:.0f} TFLOP/s" if acc.peak_flops >= 1e12 else \
            f"{acc.peak_flops / 1e9:.1f} GFLOP/s"
        if acc.shared_memory:
            ram = _size(acc.memory_bytes) if acc.memory_bytes else "unknown"
            out = [f"target    cpu: this machine, {acc.note} {peak}, RAM {ram} shared by "
                   f"{self.replicas * p.pipeline_stages} logical device(s)"]
        else:
            out = [f"target    {acc.name} = {acc.chips} {acc.kind} chips ({acc.note}); per chip {peak} bf16 "
                   f"peak, {_size(acc.memory_bytes)} HBM"]
        out += [f"layout    {self.replicas} replica(s) x {p.pipeline_stages} pipeline stage(s) x {p.tensor} tensor "
                f"way(s); precision {self.precision}; remat {'on' if p.remat else 'off'}"
                + ({"state": f"; AdamW's moments divided over the {self.replicas} replicas",
                    "grads": f"; AdamW's moments and the accumulated gradients divided over the {self.replicas} "
                             "replicas"}.get(p.shard_optimizer, "") if self.replicas > 1 else ""),
                f"batch     {t.batch_size} x {cfg.data.seq_len} = {self.tokens_per_step:,} tokens per step; per "
                f"replica {t.batch_size // self.replicas} = {t.grad_accum} grad_accum x {p.microbatches} "
                f"micro-batch(es) of {self.micro_batch}",
                f"model     {spec.params(cfg.model, self.vocab):,} parameters; vocabulary {self.vocab:,} "
                f"({self.vocab_source})"]
        out += ["partition " + line for line in pipeline.describe(self.stages)]
        full, kept = block_activation_bytes(cfg, 2 if self.precision != "float32" else 4)
        tokens_micro = self.micro_batch * cfg.data.seq_len
        out.append(f"block     activations of one block for one micro-batch: {_size(full * tokens_micro)} "
                   f"({_size(kept * tokens_micro)} with remat)")
        columns = [max(c, key=lambda mem: mem.total) for c in (self.memory, self.memory_remat)]
        heads = [f"remat {'on' if r else 'off'}, stage {c.index(m)}" for r, c, m in
                 zip((p.remat, not p.remat), (self.memory, self.memory_remat), columns)]
        if p.remat:
            columns, heads = columns[::-1], heads[::-1]
        device = "logical device" if acc.shared_memory else "chip"
        out.append(f"memory    per {device}, the most loaded stage" + "".join(f"{h:>20}" for h in heads))
        for name in [*Memory.__dataclass_fields__, "total"]:
            out.append(f"  {name:<36}" + "".join(f"{_size(getattr(c, name)):>20}" for c in columns))
        need, cap = self.memory_needed(), acc.memory_bytes
        share = f"{100 * need / cap:.0f}% of the {_size(cap)}" if cap else "RAM unknown:"
        devices = self.replicas * len(self.memory)
        whole = f"all {devices} logical devices: " if acc.shared_memory and devices > 1 else ""
        verdict = "" if self.fits(TIGHT) else ": tight (padding and reserved memory are not counted)" \
            if self.fits() else ": DOES NOT FIT"
        out.append(f"  this config (remat {'on' if p.remat else 'off'}): {whole}{_size(need)} = {share} "
                   f"{'RAM' if acc.shared_memory else 'HBM'}{verdict}")
        out.append(f"flops     {self.model_flops_per_step:.3g} per step (model: {self._flops_formula()}), "
                   f"{self.executed_flops_per_step:.3g} executed{' (remat: blocks forward twice)' if p.remat else ''}")
        busy = " / ".join(f"{100 * b:.0f}%" for b in self.busy)
        formula = (p.pipeline_stages - 1) / (p.microbatches + p.pipeline_stages - 1)
        out.append(f"pipeline  GPipe, {p.microbatches} micro-batch(es) x {p.pipeline_stages} stage(s): bubble "
                   f"{100 * self.bubble:.1f}% ((P-1)/(M+P-1) = {100 * formula:.1f}%); stages busy {busy}")
        effective = self.model_flops_per_step / (self.step_seconds * acc.peak_flops * acc.chips)
        out.append(f"time      {_seconds(self.step_seconds)} per step at {100 * self.mfu:.0f}% of peak while busy: "
                   f"{self.tokens_per_step / self.step_seconds:,.0f} tokens/s, MFU {100 * effective:.1f}% "
                   "(all-reduce, optimizer update and transfers not counted)")
        return out + self._collective_lines() + self._cpu_notes()

    def _cpu_notes(self) -> list[str]:
        out = []
        if self.acc.shared_memory and self.cfg.parallel.pipeline_stages > 1:
            out.append("note      logical CPUs share the cores: the bubble costs no time there; stages on several "
                       "devices run as a TF graph (not XLA), which keeps more intermediates than estimated")
        if self.acc.shared_memory and self.precision != "float32":
            out.append("note      XLA:CPU computes bfloat16 in float32 and keeps float32 copies: expect more memory")
        return out

    def collectives(self) -> tuple[dict[str, float], float | None]:
        """What the most loaded chip sends to the other replicas per step, and how long that takes
        (plan_time.collectives): each stage's replicas reduce that stage's gradients."""
        most = max(trainable_params(self.cfg, stage, self.vocab) for stage in self.stages)
        return collectives(self.cfg, most, self.replicas, self.acc.kind)

    def _collective_lines(self) -> list[str]:
        sent, seconds = self.collectives()
        if not sent or self.acc.shared_memory:  # logical CPUs: copies in one RAM, no interconnect
            return []
        what = ", ".join(f"{name} {_size(size)}" for name, size in sent.items())
        if seconds is None:
            return [f"comm      per chip per step: {what}; no ICI bandwidth figure for {self.acc.kind}: not timed"]
        return [f"comm      per chip per step: {what}: {_seconds(seconds)} at half the {ICI_GBPS[self.acc.kind]} GB/s "
                f"bidirectional ICI, {100 * seconds / self.step_seconds:.0f}% of the step time above if none of it "
                "overlaps the backward pass"]


def plan(cfg: Config, acc: Accelerator | str, mfu: float = 0.4, check: bool = True) -> Plan:
    """The plan for training `cfg` on `acc`; raises UserError if it cannot fit (unless check=False)."""
    from tpu_llm.training.build import check_batch_split

    acc = accelerator(acc) if isinstance(acc, str) else acc
    try:
        mfu = float(mfu)
    except (TypeError, ValueError):
        mfu = -1.0
    if not 0 < mfu <= 1:
        raise UserError(f"--mfu={mfu} must be in (0, 1]: the fraction of peak a chip sustains while busy")
    p, t = cfg.parallel, cfg.train
    per_replica = p.pipeline_stages * p.tensor
    if acc.shared_memory:
        if p.tensor > 1:
            # off-TPU the weights stay whole on each replica's first device and its groups read
            # slices of them: the per-core memory model below (weights split T ways) does not apply
            raise UserError(f"parallel.tensor={p.tensor}: the planner models tensor parallelism on TPU chips "
                            "only; plan a TPU accelerator or set parallel.tensor=1")
        if cfg.cpu_devices % p.pipeline_stages or cfg.cpu_devices < p.pipeline_stages:
            raise UserError(f"cpu_devices={cfg.cpu_devices} must be a multiple of parallel.pipeline_stages="
                            f"{p.pipeline_stages} (one logical device per stage, per replica)")
        replicas = cfg.cpu_devices // p.pipeline_stages
    else:
        if acc.chips % per_replica:
            raise UserError(f"{acc.name} has {acc.chips} chips, which do not split into replicas of "
                            f"parallel.pipeline_stages={p.pipeline_stages} x parallel.tensor={p.tensor} = "
                            f"{per_replica} chips; use a slice with a multiple of {per_replica} chips")
        replicas = acc.chips // per_replica
    check_batch_split(t.batch_size, replicas, t.grad_accum, p.microbatches)
    precision = cfg.precision if cfg.precision != "auto" else (
        "float32" if acc.shared_memory else "mixed_bfloat16")
    act_bytes = 4 if precision == "float32" else 2
    vocab, source = vocab_size(cfg)
    seq = cfg.data.seq_len
    stages = pipeline.partition(cfg.model, vocab, seq, p.pipeline_stages)
    micro = t.batch_size // (replicas * t.grad_accum * p.microbatches)
    tokens_micro = micro * seq
    memory, memory_remat = ([stage_memory(cfg, s, vocab, act_bytes, tokens_micro * p.microbatches, tokens_micro,
                                          remat, replicas) for s in stages] for remat in (p.remat, not p.remat))

    model_flops, executed, step, bubble, busy = step_time(cfg, acc, mfu, stages, vocab, tokens_micro)
    result = Plan(cfg, acc, vocab, source, precision, replicas, micro, stages, memory, memory_remat,
                  model_flops, executed, mfu, step, bubble, busy)
    if check:
        result.check()
    return result


def _params(cfg: Config, vocab: int) -> int:
    """GPT.num_params() of the config's model, as tools/bench.py prints it."""
    return spec.params(cfg.model, vocab)


def _size(x: float) -> str:
    for unit, scale in (("TiB", GIB * 1024), ("GiB", GIB), ("MiB", 2.0**20), ("KiB", 1024.0)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"
