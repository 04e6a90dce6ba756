"""The HLO a TPU compiles for a TPUStrategy step, produced offline by TensorFlow's own compiler code.

On a TPU, TF 2.20 (its default bridge) turns the traced step into a program like this:

1. `TPUStrategy.run` inside the train loop's tf.function marks every op of the replica computation
   with `_tpu_replicate` (tpu.replicate). EncapsulateTPUComputationsPass cuts those ops out into a
   function whose arguments are the replicated inputs and variables.
2. DistributedTPURewritePass gives every argument a core (`AssignArgsAndRetvalsToCores`,
   distributed_tpu_rewrite_pass.cc): the lowest core annotated on an op that uses it, looking into
   the functions it is passed to, else core 0; a return value the core of the op producing it.
3. TPUCompile compiles the function with tf2xla's XlaCompiler, which first inlines every nested
   function with the single-device body placer (compile_tf_graph.cc, xla_compiler.cc: an inlined op
   takes the device of the call) and then turns each op's `TPU_REPLICATED_CORE:k` into the HLO
   instruction's `sharding={maximal device=k}`. An op left without a core gets no sharding.

Here: `cluster` does step 1 on the traced loop, `argument_cores` step 2 with the same rule, and
`compile_hlo` step 3 with the same XlaCompiler (`experimental_get_compiler_ir`'s entry point, stage
"hlo": tf2xla's output before XLA's own passes, for the CPU). What differs from a TPU: the CPU
build has no XLA kernel for the TPU's collectives (CrossReplicaSum, AllToAll); they compile as
XlaAllReduce, which is an HLO all-reduce too but whose lowering drops the core annotation, so a
collective's core is read from its TensorFlow op (`Cluster.devices`). XLA's TPU passes after this
(what it does with unannotated instructions, the copies between cores) are not run: a TPU's own
dump (`XLA_FLAGS=--xla_dump_to=DIR`) shows those.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re

import tensorflow as tf

from tpu_llm.platform import tf_compat

CORE = "TPU_REPLICATED_CORE:"
FEED = "feed/"  # prefix of the placeholder standing for each input of the replica computation
_COMPILED = itertools.count()  # names the functions compiled


def _feed(tensor: str) -> str:
    return FEED + tensor.replace(":", "_")


def node_core(node) -> int | None:
    """The core an op is annotated for (tf2xla's ParseShardingFromDevice): its `_XlaSharding`
    attribute if maximal, else the k of a TPU_REPLICATED_CORE:k device."""
    if "_XlaSharding" in node.attr:
        return tf_compat.sharding_core(node.attr["_XlaSharding"].s)
    return int(node.device.split(CORE)[-1]) if CORE in node.device else None


class _Graph:
    """The nodes of a GraphDef and, per node, the (consumer, input index) of its outputs."""

    def __init__(self, nodes):
        self.nodes = {n.name: n for n in nodes}
        self.consumers = collections.defaultdict(list)
        for n in nodes:
            data_inputs = [i for i in n.input if not i.startswith("^")]
            for k, name in enumerate(data_inputs):
                self.consumers[name.split(":")[0]].append((n, k))


@dataclasses.dataclass
class Cluster:
    """The replica computation of a traced TPUStrategy loop, cut out as on a TPU (step 1)."""
    graph_def: tf.compat.v1.GraphDef  # its ops, each input from outside as a placeholder (_feed)
    feeds: list  # the loop body's tensors it reads, in argument order
    sources: dict  # feed -> the body's node producing it (TPUReplicatedInput for replicated ones)
    fetches: list  # its tensors the loop body reads
    library: object  # FunctionDefLibrary: the functions it calls
    body: object  # the loop body's FunctionDef
    devices: dict  # op name -> its device, for the ops standing in for the TPU's collectives
    edited: frozenset = frozenset()  # the functions of `library` whose collectives got a stand-in
    _functions: dict = dataclasses.field(default_factory=dict)

    def function(self, name: str) -> tuple[_Graph, list]:
        """A called function's body and its argument names."""
        if name not in self._functions:
            fdef = next(f for f in self.library.function if f.signature.name == name)
            self._functions[name] = (_Graph(tf_compat.function_graph_def(fdef).node), [a.name for a in fdef.signature.input_arg])
        return self._functions[name]


def _stand_in(node, graph_def) -> None:
    """An XLA-on-CPU stand-in for a TPU collective, in place: CrossReplicaSum -> XlaAllReduce (Add);
    AllToAll (TPUStrategy's broadcast of an int64 ONLY_FIRST_REPLICA update) -> an int32 XlaAllReduce
    between two casts, keeping the op's name and device for its consumers."""
    if node.op == "CrossReplicaSum":
        node.op = "XlaAllReduce"
    elif node.op == "AllToAll":
        for attr in ("split_dimension", "split_count", "concat_dimension"):
            node.attr.pop(attr)
        dtype, name = node.attr["T"].type, node.name
        node.op, node.name, node.attr["T"].type = "XlaAllReduce", name + "/all_to_all", tf.int32.as_datatype_enum
        into = graph_def.node.add(name=name + "/to_int32", op="Cast", device=node.device, input=[node.input[0]])
        into.attr["SrcT"].type, into.attr["DstT"].type = dtype, tf.int32.as_datatype_enum
        node.input[0] = into.name
        back = graph_def.node.add(name=name, op="Cast", device=node.device, input=[node.name])
        back.attr["SrcT"].type, back.attr["DstT"].type = tf.int32.as_datatype_enum, dtype
    else:
        return
    node.attr["reduce_op"].s, node.attr["mode"].s = b"Add", b"CrossReplica"


def cluster(function) -> Cluster:
    """Step 1 on a concrete train or eval loop: the `_tpu_replicate` ops of its loop body."""
    outer = function.graph.as_graph_def()
    bodies = [f for f in outer.library.function if any(n.op == "TPUReplicateMetadata" for n in f.node_def)]
    if len(bodies) != 1:
        raise ValueError(f"expected one TPU computation in {function.name}, found {len(bodies)}")
    body_def = tf_compat.function_graph_def(bodies[0])
    inside = {n.name for n in body_def.node if "_tpu_replicate" in n.attr and n.op != "TPUReplicateMetadata"}
    body = {n.name: n for n in body_def.node}
    graph_def, feeds, devices = tf.compat.v1.GraphDef(), {}, {}
    for n in body_def.node:
        if n.name not in inside:
            continue
        node = graph_def.node.add()
        node.CopyFrom(n)
        node.attr.pop("_tpu_replicate")
        del node.input[:]
        for name in n.input:
            if name.lstrip("^").split(":")[0] in inside:
                node.input.append(name)
            elif not name.startswith("^"):  # control inputs from outside (the metadata) do not cross
                tensor = name if ":" in name else name + ":0"
                feeds[tensor] = body[tensor.split(":")[0]]
                node.input.append(_feed(tensor))
        if n.op in ("CrossReplicaSum", "AllToAll"):
            devices[n.name] = n.device
            _stand_in(node, graph_def)
    for tensor, source in feeds.items():
        dtype = source.attr["T"] if "T" in source.attr else source.attr["dtype"]
        graph_def.node.add(name=_feed(tensor), op="Placeholder").attr["dtype"].CopyFrom(dtype)
    fetches = sorted({name if ":" in name else name + ":0" for n in body_def.node if n.name not in inside
                      for name in n.input if not name.startswith("^") and name.split(":")[0] in inside})
    # a sum over the replicas inside a function the replica computation calls (parallel.shard_optimizer=
    # grads: the accumulation loop's body on TPU) gets the same stand-in, a change of op alone (the loop
    # body cut out above is not one of them: its ops are in graph_def)
    library, edited = type(outer.library)(), set()
    library.CopyFrom(outer.library)
    for f in library.function:
        if f.signature.name == bodies[0].signature.name:
            continue
        for n in f.node_def:
            if n.op == "CrossReplicaSum":
                devices.setdefault(n.name, n.device)
                _stand_in(n, None)
                edited.add(f.signature.name)
    return Cluster(graph_def, sorted(feeds), feeds, fetches, library, bodies[0], devices, frozenset(edited))


def _function_names(node) -> list[str]:
    return [v.func.name for v in node.attr.values() if v.HasField("func")] + \
           [f.name for v in node.attr.values() for f in v.list.func]


def _adjacent_core(graph: _Graph, node) -> int | None:
    """ParseInputShardingFromAdjacentNode: the node's own core, else an XlaSharding op's reached
    through Identity and Cast ops."""
    core = node_core(node)
    if core is not None:
        return core
    reached, todo = [], [node]
    while todo:
        n = todo.pop()
        reached.append(n)
        if n.op in ("Identity", "Cast"):
            todo.extend(c for c, _ in graph.consumers[n.name])
    return next((node_core(n) for n in reached if n.op == "XlaSharding" and node_core(n) is not None), None)


def _neighbour_core(graph: _Graph, node) -> int | None:
    """ParseAndValidateShardingFromNeighbors for one user of an argument (a variable read: its users)."""
    core = _adjacent_core(graph, node)
    if core is None and node.op == "ReadVariableOp":
        core = next((c for c in (_adjacent_core(graph, user) for user, _ in graph.consumers[node.name])
                     if c is not None), None)
    return core


def _lowest_user_core(graph: _Graph, name: str, cluster_: Cluster) -> int | None:
    """InferXlaShardingFromNeighbors: the lowest core among the users of `name`'s output, following it
    into every function it is passed to (by argument index, as TF does)."""
    cores = []
    for user, index in graph.consumers[name]:
        cores.append(_neighbour_core(graph, user))
        for function in _function_names(user):
            body, args = cluster_.function(function)
            if index < len(args):
                cores.append(_lowest_user_core(body, args[index], cluster_))
    cores = [c for c in cores if c is not None]
    return min(cores) if cores else None


def argument_cores(cluster_: Cluster) -> list[int]:
    """Step 2: each argument's core (an argument no annotated op uses: core 0, as TF does for
    variables; per-replica inputs TF spreads by size instead, which only moves a few token ids)."""
    graph = _Graph(cluster_.graph_def.node)
    return [c if c is not None else 0 for c in (_lowest_user_core(graph, _feed(t), cluster_) for t in cluster_.feeds)]


def return_cores(cluster_: Cluster) -> list[int]:
    """Step 2 for the return values: the core of the op producing each, else 0."""
    graph = _Graph(cluster_.graph_def.node)
    return [node_core(graph.nodes[t.split(":")[0]]) or 0 for t in cluster_.fetches]


def arguments(function, cluster_: Cluster, variables: list) -> tuple[list, list]:
    """The values to compile the computation for, one per feed, and the TPU variable behind each (None
    for the per-replica inputs): a variable's first replica's copy, zeros of a feed's shape otherwise.
    A variable reaches the computation as a loop-body argument fed by the loop's capture of its
    (packed) handle; a handle none of `variables` owns raises (the step reads a variable the audit
    does not know)."""
    owners = {id(handle): v for v in variables for handle in tf_compat.replica_handles(v)}
    loop = next(op for op in function.graph.get_operations()
                if op.type in ("While", "StatelessWhile") and op.get_attr("body").name == cluster_.body.signature.name)
    position = {a.name: i for i, a in enumerate(cluster_.body.signature.input_arg)}
    captured = {id(internal): external for external, internal in function.graph.captures}
    body_graph = tf_compat.function_graph(cluster_.body)
    args, owners_of_args = [], []
    for tensor in cluster_.feeds:
        source = cluster_.sources[tensor]
        if source.op == "TPUReplicatedInput" and source.attr["T"].type == tf.resource.as_datatype_enum:
            inner = loop.inputs[position[source.input[0].split(":")[0]]]
            while id(inner) not in captured and inner.op.type == "Identity":
                inner = inner.op.inputs[0]
            v = owners.get(id(captured.get(id(inner))))
            if v is None:
                raise ValueError(f"the step reads a variable the audit does not know: {source.name}")
            args.append(v.values[0].handle)
            owners_of_args.append(v)
        else:
            t = body_graph.get_tensor_by_name(tensor)
            args.append(tf.zeros(t.shape, t.dtype))
            owners_of_args.append(None)
    return args, owners_of_args


def compile_hlo(cluster_: Cluster, args: list, arg_cores: list[int], stage: str = "hlo") -> str:
    """Step 3: the HLO text XlaCompiler makes of the computation, for `args` (tensors, and variables'
    handles for the resources) assigned to `arg_cores`. `stage` "optimized_hlo" also runs XLA's CPU
    passes, as a real compile does: XLA_FLAGS=--xla_dump_to then dumps the module (tests/test_doctor_hlo.py)."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(cluster_.graph_def, name="")
        outputs = []
        for tensor, core in zip(cluster_.fetches, return_cores(cluster_)):
            # a device on a non-Identity op: XlaCompiler gives the return value its neighbour's core
            with tf.device(f"/device:{CORE}{core}"):
                outputs.append(tf_compat.assign_core(graph.get_tensor_by_name(tensor), core))
    inputs = [graph.get_tensor_by_name(_feed(t) + ":0") for t in cluster_.feeds]
    fdef = tf_compat.graph_function_def(graph, [op for op in graph.get_operations() if op.type != "Placeholder"],
                                        inputs, outputs, f"tpu_replica_computation_{next(_COMPILED)}")
    for i, core in enumerate(arg_cores):  # as DistributedTPURewritePass marks the _Arg nodes
        fdef.arg_attr[i].attr["_XlaSharding"].s = tf_compat.maximal_sharding(core)
    return tf_compat.compiler_ir(fdef, cluster_.library, args, stage=stage, replaced=cluster_.edited)


def step_hlo(step, which: str = "train", stage: str = "hlo") -> tuple[str, list]:
    """Steps 1-3 on an offline step (harness/offline_tpu.py's Step): the HLO text of its `which` loop's
    replica computation, each argument on the core TF's rewrite gives it, and the variable behind each
    argument (None for the others)."""
    function = step.function(which)
    cluster_ = cluster(function)
    args, owners = arguments(function, cluster_, step.variables())
    return compile_hlo(cluster_, args, argument_cores(cluster_), stage), owners


# ---- reading the HLO text --------------------------------------------------------------------------

_INSTRUCTION = re.compile(r"^\s*(ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")
_ALIAS = re.compile(r"\{(\d+)\}: \((\d+), \{\}")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # e.g. bf16[32,96]{1,0}
    opcode: str
    operands: list
    core: int | None  # sharding={maximal device=k}
    op_name: str  # the TensorFlow op it came from (metadata), "" if none
    attributes: str
    root: bool = False
    computation: str = ""  # the computation it is in (a fusion's body: what the fusion calls)

    def dims(self) -> tuple[int, ...]:
        found = re.match(r"\w+\[([\d,]*)\]", self.shape)
        return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def _operands(rest: str) -> tuple[list[str], str]:
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return re.findall(r"%([^\s,()]+)", rest[:i]), rest[i + 1:]
    return [], rest


@dataclasses.dataclass
class Module:
    """An HLO module's instructions (every computation's), its entry's parameters and the outputs that
    update a parameter (input_output_alias: output index -> parameter number)."""
    instructions: dict  # name -> Instruction
    parameters: dict  # entry parameter number -> Instruction
    root: Instruction
    aliases: dict
    roots: dict  # computation name -> its ROOT instruction (a while loop's body: what an iteration returns)

    @classmethod
    def parse(cls, text: str) -> Module:
        instructions, parameters, root, entry, roots, computation = {}, {}, None, False, {}, ""
        header = text.split("\n", 1)[0]
        aliases = {int(o): int(p) for o, p in _ALIAS.findall(header.split("input_output_alias=")[-1])} \
            if "input_output_alias=" in header else {}
        for line in text.splitlines():
            if line.rstrip().endswith("{") and not line.startswith(" "):
                entry = line.startswith("ENTRY")
                computation = line.split()[1 if entry else 0].lstrip("%")
                continue
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            is_root, name, shape, opcode, rest = found.groups()
            operands, attributes = _operands(rest)
            core = re.search(r"sharding=\{maximal device=(\d+)\}", attributes)
            op_name = re.search(r'op_name="([^"]*)"', attributes)
            ins = Instruction(name, shape, opcode, operands, int(core.group(1)) if core else None,
                              op_name.group(1) if op_name else "", attributes, bool(is_root) and entry, computation)
            instructions[name] = ins
            if entry and opcode == "parameter":
                parameters[int(re.match(r"\s*(\d+)", rest).group(1))] = ins
            if is_root:
                roots[computation] = ins
            if ins.root:
                root = ins
        return cls(instructions, parameters, root, aliases, roots)

    def output(self, index: int) -> Instruction:
        return self.instructions[self.root.operands[index]]

    def producer(self, ins: Instruction) -> Instruction:
        """The instruction computing a returned value: past the copies and reshapes XlaCompiler adds, and
        through tuples and while loops (a value a loop carries: what its body computes)."""
        while True:
            if ins.op_name == "XLA_Retvals" and ins.operands:
                ins = self.instructions[ins.operands[0]]
                continue
            if ins.opcode != "get-tuple-element":
                return ins
            index = int(re.search(r"index=(\d+)", ins.attributes).group(1))
            source = self.instructions[ins.operands[0]]
            if source.opcode == "tuple":
                ins = self.instructions[source.operands[index]]
            elif source.opcode == "while":
                body = self.roots[re.search(r"body=%?([^\s,]+)", source.attributes).group(1)]
                ins = self.instructions[body.operands[index]]
            else:
                return ins
