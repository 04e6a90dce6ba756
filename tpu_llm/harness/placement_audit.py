"""Where the train step's work runs on a replica's TPU cores, proven in the program XLA compiles, offline
(`tpu-llm bench placement`; tests/test_placement.py asserts it).

A device annotation is only a claim until the compiled program shows it: TF's TPU compiler inlines
nested functions giving every inlined op the device of the call, and what is left without a core is
placed by XLA (TPUStrategy's own rule says core 0). So the audit that counts is `compiled`: the run's
Trainer is built on TF's real TPUStrategy with no TPU (harness/offline_tpu.py), its train loop traced
through `TPUStrategy.run`, and its replica computation compiled to HLO as a TPU's TPUCompile would,
by TensorFlow's own XlaCompiler (harness/compiled_step.py says what is reproduced and what is not).
It counts per logical core the `dot`/`convolution` instructions, forward and backward (an op whose
TensorFlow name lies under a `gradient_tape`/`gradients` scope is backward), the collectives, and
for each variable the core of its input and output and the core that computes the value written.

`traced` is the second view: op device attributes in the traced graph, before XLA. It showed the
stages' reductions and updates moving to their cores (it still does), but it cannot see what the
compiler keeps. What neither shows: XLA's TPU passes after tf2xla, the copies between cores, memory
and speed; `tpu-llm doctor` on a real TPU measures those.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import time

from tpu_llm.harness import compiled_step
from tpu_llm.harness.offline_tpu import REPLICAS, Step, build_step
from tpu_llm.model import families, spec

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (2, 4)]  # (pipeline stages P, tensor groups T)
TOLERANCE = 0.25  # each core's (stage's) share vs the mean of those that should share the work
GRADIENT = re.compile(r"(?:^|[/;])gradient(?:s|_tape)(?:_\d+)?/")  # TF names backward ops under these scopes
BLOCK = re.compile(r"(?:^|[/;])block_(\d+)(?:_\d+)?/")
MATMULS = ("dot", "convolution")
COLLECTIVES = ("all-reduce", "all-to-all", "all-gather", "reduce-scatter", "collective-permute")


@dataclasses.dataclass
class Problem:
    kind: str  # unplaced | uneven | off its stage | variable | full kernel | collective
    text: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.text}"


@dataclasses.dataclass
class VariablePlacement:
    name: str
    home: int | None  # the logical core TPUStrategy created it on
    input: int  # the core of its parameter in the compiled program (its output, if written, too)
    written_from: int | None | str  # the core computing the value written; "-" when not written


@dataclasses.dataclass
class CompiledAudit:
    """Per-core counts of one layout's compiled step (None: an instruction without a core)."""
    stages: int
    tensor: int
    what: str  # "gpt2, mixed_bfloat16, grad_accum 2, dropout 0.1, train step"
    counts: dict  # kind -> Counter(core or None -> instructions)
    variables: list  # VariablePlacement per variable the step reads
    off_stage: collections.Counter  # (block, core, stage's first and last core) -> its matmuls outside its stage
    # (core, backward?, "opcode shape of op name"): a group core other than its stage's first making a whole kernel
    full_kernels: list
    wide_unplaced_collectives: list  # op names of collectives without a core moving more than a scalar per replica
    seconds: dict  # "trace" and "compile": wall seconds

    def cores(self) -> range:
        return range(self.stages * self.tensor)

    def table(self) -> list[str]:
        head = f"{'P x T = %d x %d' % (self.stages, self.tensor):<19}"
        head += "".join(f"{'core %d' % c:>9}" for c in self.cores())
        rows = [f"compiled HLO (tf2xla, as TPUCompile): {self.what}; trace {self.seconds['trace']:.0f} s, "
                f"compile {self.seconds['compile']:.0f} s", head + f"{'no core':>9}"]
        for kind, counter in self.counts.items():
            rows.append(f"{kind:<19}" + "".join(f"{counter.get(c, 0):>9}" for c in self.cores())
                        + f"{counter.get(None, 0):>9}")
        return rows

    def problems(self) -> list[Problem]:
        """Every stage's and group's forward and backward matmuls on its own cores, within TOLERANCE of
        even; none without a core; each variable read and written on the core it lives on; no group
        core but a stage's first receiving a whole kernel; collectives on their stage's core."""
        P, T = self.stages, self.tensor
        if P * T == 1:  # one core per replica: nothing to place (and nothing is annotated)
            return []
        out = [Problem("unplaced", f"{self.counts[kind][None]} {kind} carry no core (XLA places them; "
                                   "TPUStrategy's rule: core 0)")
               for kind in ("forward matmuls", "backward matmuls") if self.counts[kind][None]]
        if P > 1 and self.counts["weight-shaped adds"][None]:  # (one stage: its core is where they default to)
            out.append(Problem("unplaced", f"{self.counts['weight-shaped adds'][None]} adds of a weight's shape "
                                           "(gradient sums: accumulation, a tied table's uses) carry no core"))
        out += matmul_spread(self.counts, P, T)
        if P > 1:
            out += uneven(self.counts["collectives"], "collectives", [i * T for i in range(P)],
                          "the stages' first cores")
        out += [Problem("off its stage", f"{n} matmuls of block {b} on core {c}; its stage's cores are {first}-{last}")
                for (b, c, first, last), n in sorted(self.off_stage.items())]
        if P > 1 and self.wide_unplaced_collectives:  # (one stage: its core is where they default to)
            names = self.wide_unplaced_collectives
            out.append(Problem("collective", f"{len(names)} collectives moving more than a scalar per replica carry "
                                             f"no core: {', '.join(names[:3])}{', ...' * (len(names) > 3)}"))
        misplaced = collections.defaultdict(list)  # what is wrong -> variables
        for v in self.variables:
            if v.home is not None and v.input != v.home:
                misplaced[f"live on core {v.home}, read and written on core {v.input}"].append(v.name)
            if v.written_from not in ("-", v.home) and not (v.written_from is None and v.home == 0):
                where = "no core" if v.written_from is None else f"core {v.written_from}"
                misplaced[f"live on core {v.home}, their new value comes from {where}"].append(v.name)
        out += [Problem("variable", f"{len(names)} {what}: {', '.join(names)}") for what, names in misplaced.items()]
        for core in sorted({c for c, _, _ in self.full_kernels}):
            found = [(backward, what) for c, backward, what in self.full_kernels if c == core]
            backward = sum(b for b, _ in found)
            out.append(Problem("full kernel", f"core {core} (tensor group {core % T} of stage {core // T}) computes "
                                              f"{len(found)} tensors of a whole kernel's shape ({len(found) - backward} "
                                              f"forward, {backward} backward), e.g. "
                                              + "; ".join(w for _, w in found[:3])))
        return out


def uneven(counter: collections.Counter, kind: str, groups: list, what: str) -> list[Problem]:
    """[the Problem] when the `groups` (a core, or a range of cores each) do not share `counter`'s
    instructions within TOLERANCE of even, naming core 0 when it is the heavy one; [] when they do, or
    when there are none of `kind` at all (the evaluation step's backward)."""
    if not sum(counter.values()):
        return []
    counts = [sum(counter.get(c, 0) for c in (g if isinstance(g, range) else [g])) for g in groups]
    mean = sum(counts) / len(counts)
    if mean and all(abs(n - mean) <= TOLERANCE * mean for n in counts):
        return []
    heavy = " (core 0 heavy)" if counts[0] == max(counts) and counts[0] > (1 + TOLERANCE) * mean else ""
    return [Problem("uneven", f"{kind} of {what}: {counts} (not within {TOLERANCE:.0%} of an even split){heavy}")]


def matmul_spread(counts: dict, stages: int, tensor: int) -> list[Problem]:
    """The forward and backward matmuls (counts[kind]: Counter(core -> instructions)) shared within
    TOLERANCE of even by each stage's tensor groups and by the stages: the rule of the offline audit and
    of `tpu-llm doctor`'s audit of a TPU's own HLO dump (tools/doctor/hlo.py)."""
    P, T, out = stages, tensor, []
    for kind in ("forward matmuls", "backward matmuls"):
        if T > 1:
            for i in range(P):
                out += uneven(counts[kind], kind, [i * T + g for g in range(T)], f"stage {i}'s tensor groups")
        if P > 1:
            out += uneven(counts[kind], kind, [range(i * T, (i + 1) * T) for i in range(P)], "the stages")
    return out

def _kernel_shapes(step: Step) -> set:
    """The shapes (sorted, without 1s) of every block's weight matrices, and a fused q/k/v kernel as
    the (C, 3, heads, head size) a group slices; less the shapes of a group's own slices (a slice of one
    kernel may have another whole kernel's shape: with 4 groups of the audit's model, the MLP's (C, F/4)
    slice is the attention projection's (C, C); such a shape cannot tell a slice from a kernel)."""
    cfg = step.model.cfg
    shapes = {tuple(sorted(d for d in v.shape if d != 1)) for b in step.model.blocks for v in b.trainable_variables
              if len(v.shape) >= 2}
    if families.of(cfg).block.qkv == "fused":
        shapes.add(tuple(sorted((cfg.n_embd, 3, cfg.n_head, spec.head_dim(cfg)))))
    if step.tensor > 1:
        shapes -= {tuple(sorted(d for d in s if d != 1)) for s in spec.group_shapes(cfg, step.tensor).values()}
    return shapes


def _collective_core(ins, cluster) -> int | None:
    if ins.core is not None:
        return ins.core
    name = ins.op_name.split(";")[0].removesuffix("/all_to_all")
    device = cluster.devices.get(name, "")
    return int(device.split(compiled_step.CORE)[-1]) if compiled_step.CORE in device else None


def _elements(ins) -> int:
    n = 1
    for d in ins.dims():
        n *= d
    return n


def compiled(stages: int, tensor: int, *, precision: str = "mixed_bfloat16", dropout: float = 0.1,
             grad_accum: int = 2, family: str = "gpt2", which: str = "train", step: Step | None = None) -> CompiledAudit:
    """Build (or take) the layout's step, compile its replica computation (`which`: the train or the eval
    step) to HLO as a TPU would, and count where each instruction runs."""
    step = step or build_step(stages, tensor, precision=precision, dropout=dropout, grad_accum=grad_accum,
                              family=family)
    function = step.function(which)
    start = time.perf_counter()
    cluster = compiled_step.cluster(function)
    args, owners = compiled_step.arguments(function, cluster, step.variables())
    cores = compiled_step.argument_cores(cluster)
    module = compiled_step.Module.parse(compiled_step.compile_hlo(cluster, args, cores))
    seconds = {"trace": step.seconds, "compile": time.perf_counter() - start}
    counts = {kind: collections.Counter() for kind in
              ("forward matmuls", "backward matmuls", "weight-shaped adds", "collectives", "variables in/out",
               "variables written")}
    off_stage, full_kernels, wide = collections.Counter(), [], []
    kernels = _kernel_shapes(step)
    weights = {tuple(v.shape) for v in step.model.trainable_variables if len(v.shape) >= 2}
    T = step.tensor
    for ins in module.instructions.values():
        if ins.opcode in MATMULS:
            counts["backward matmuls" if GRADIENT.search(ins.op_name) else "forward matmuls"][ins.core] += 1
            block = BLOCK.search(ins.op_name)
            if block and ins.core is not None and step.stages > 1:
                own = step.stage_cores(int(block.group(1)))
                if ins.core not in own:
                    off_stage[int(block.group(1)), ins.core, own.start, own.stop - 1] += 1
        if ins.opcode == "add" and ins.dims() in weights:  # gradient sums: micro-batches, a tied table's two uses

            counts["weight-shaped adds"][ins.core] += 1
        if ins.opcode in COLLECTIVES:
            core = _collective_core(ins, cluster)
            counts["collectives"][core] += 1
            if core is None and _elements(ins) > REPLICAS:
                wide.append(ins.op_name)
        if T > 1 and ins.core is not None and ins.core % T and tuple(sorted(d for d in ins.dims() if d != 1)) in kernels:
            full_kernels.append((ins.core, bool(GRADIENT.search(ins.op_name)),
                                 f"{ins.opcode} {ins.shape.split('{')[0]} of {ins.op_name.split(';')[0]}"))
    written = {param: module.producer(module.output(out)).core for out, param in module.aliases.items()}
    variables = []
    for i, v in enumerate(owners):
        if v is not None:
            placement = VariablePlacement(step.path(v), step.home(v), module.parameters[i].core, written.get(i, "-"))
            variables.append(placement)
            counts["variables in/out"][placement.input] += 1
            if placement.written_from != "-":
                counts["variables written"][placement.written_from] += 1
    what = f"{step.family}, {step.precision}, grad_accum {step.grad_accum}, dropout {step.dropout}, {which} step"
    return CompiledAudit(step.stages, step.tensor, what, counts, variables, off_stage, full_kernels, wide, seconds)


# ---- the second view: device attributes of the traced graph, before XLA ------------------------------

KINDS = ("forward matmuls", "backward matmuls", "variable writes", "all-reduces")
GRAPH_MATMULS = ("MatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
# scalars the whole replica shares may stay on core 0: the loss's mean over replicas, the optimizer's
# step counter and LossScaleOptimizer's bookkeeping (its scale and growth counter: 8 writes)
SHARED_ALLOWED = {"forward matmuls": 0, "backward matmuls": 0, "variable writes": 10, "all-reduces": 1}
TRACED_TOLERANCE = 0.35


@dataclasses.dataclass
class TracedAudit:
    stages: int
    tensor: int
    per_core: dict  # logical core -> Counter(kind -> ops)
    shared: collections.Counter  # kind -> ops without a core annotation (core 0)

    def problems(self) -> list[str]:
        """What is not spread in the traced graph: each stage's work on its own cores, its T groups
        sharing the matmuls, the stages sharing the updates and reductions (each of its own variables)."""
        P, T = self.stages, self.tensor
        if P * T == 1:  # one core per replica: nothing to spread (and nothing is annotated)
            return []
        # with one stage, core 0 is the stage's own core; with several, work left there is another stage's
        out = [f"{n} {kind} have no core annotation (they run on core 0); at most {SHARED_ALLOWED[kind]} may"
               for kind, n in self.shared.items() if P > 1 and n > SHARED_ALLOWED[kind]]

        def even(kind, cores, what):
            counts = [self.count(c, kind) for c in cores]
            mean = sum(counts) / len(counts)
            if mean == 0 or any(abs(n - mean) > TRACED_TOLERANCE * mean for n in counts):
                out.append(f"{kind} of {what}: {counts} on cores {list(cores)} (not within {TRACED_TOLERANCE:.0%} "
                           "of an even split)")

        for i in range(P):
            if T > 1:
                for kind in ("forward matmuls", "backward matmuls"):
                    even(kind, range(i * T, (i + 1) * T), f"stage {i}'s tensor groups")
        if P > 1:
            for kind in KINDS:
                groups = [i * T for i in range(P)]
                if kind in ("forward matmuls", "backward matmuls"):
                    groups = list(range(P * T))
                even(kind, groups, "the stages")
        return out

    def count(self, core: int, kind: str) -> int:
        """The ops of `kind` that run on `core`: those annotated for it, and for core 0 the unannotated."""
        return self.per_core.get(core, {}).get(kind, 0) + (self.shared.get(kind, 0) if core == 0 else 0)

    def table(self) -> list[str]:
        cores = range(self.stages * self.tensor)
        rows = ["traced graph, before XLA (second view: device attributes, not what the compiler keeps)",
                f"{'P x T = %d x %d' % (self.stages, self.tensor):<19}" + "".join(f"{'core %d' % c:>9}" for c in cores)
                + f"{'no core':>9}"]
        for kind in KINDS:
            rows.append(f"{kind:<19}" + "".join(f"{self.per_core.get(c, {}).get(kind, 0):>9}" for c in cores)
                        + f"{self.shared.get(kind, 0):>9}")
        return rows


def _kind(node) -> str | None:
    if node.op in GRAPH_MATMULS:
        return "backward matmuls" if "gradient" in node.name.lower() else "forward matmuls"
    if node.op.startswith("Assign") and node.op.endswith("VariableOp"):
        return "variable writes"
    if node.op == "CrossReplicaSum":
        return "all-reduces"
    return None


def traced(stages: int, tensor: int, *, loss_scaling: bool = True, dropout: float = 0.1, grad_accum: int = 2,
           family: str = "gpt2", step: Step | None = None) -> TracedAudit:
    """The traced train step's ops per logical core by their device attributes (loss scaling:
    mixed_float16, else float32; or the given `step`)."""
    step = step or build_step(stages, tensor, precision="mixed_float16" if loss_scaling else "float32",
                              dropout=dropout, grad_accum=grad_accum, family=family)
    graph = step.function("train").graph
    per_core: dict = {}
    shared: collections.Counter = collections.Counter()
    for function in graph.as_graph_def().library.function:
        for node in function.node_def:
            kind = _kind(node)
            if kind is None:
                continue
            if compiled_step.CORE in node.device:
                core = int(node.device.split(compiled_step.CORE)[-1])
                per_core.setdefault(core, collections.Counter())[kind] += 1
            else:
                shared[kind] += 1
    return TracedAudit(step.stages, step.tensor, per_core, shared)


def run(say=print, layouts=LAYOUTS) -> list[CompiledAudit]:
    """`tpu-llm bench placement`: per layout, the compiled step's table and its problems, then the
    traced graph's (second view) of the same step."""
    audits = []
    for stages, tensor in layouts:
        step = build_step(stages, tensor)
        audit = compiled(stages, tensor, step=step)
        audits.append(audit)
        for line in audit.table():
            say(line)
        for problem in audit.problems():
            say(f"  NOT PLACED: {problem}")
        for line in traced(stages, tensor, step=step).table():
            say(line)
        say("")
    return audits
