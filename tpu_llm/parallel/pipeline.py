"""Pipeline parallelism: group the model's blocks into stages, place them, run micro-batches through.

Partition: the blocks are cut into P contiguous stages so that the slowest stage (training FLOPs per
token, tpu_llm/model/spec.py) is as fast as possible; the embedding goes with the first stage, the final
norm and the tied output head with the last. The head's matmul is worth several blocks on a small model, so the last
stage usually gets fewer blocks.

Schedule (GPipe): each replica's batch is split into M micro-batches; micro-batch m flows through
stage 0, 1, ..., P-1, each stage under its Placement (a device off-TPU, a logical core on TPU); the
loss is the mean over micro-batches and one GradientTape takes the backward pass through all of it.
Nothing orders the micro-batches explicitly: TensorFlow's dataflow executor runs any op whose inputs
are ready, so stage 0 starts micro-batch m+1 while stage 1 works on m, and the backward pass drains
the same way. That is GPipe's schedule, with its bubble of (P-1)/(M+P-1).

Why not 1F1B: 1F1B's gain is memory (a stage holds at most P micro-batches' activations), and it needs
the backward of micro-batch m to run before the forward of m+P. A single tape computes the backward
after the whole forward, and forcing an order with control dependencies would need a separate tape
and gradient call per (stage, micro-batch), which in a dataflow graph still does not free activations
any earlier than the executor already does. Rematerialisation (`parallel.remat`, tf.recompute_grad
per block) is the memory lever here instead.

Where: each stage's variables are created on its own device or logical TPU core (`build_weights`
under `Placement.variables_at`), AdamW's moments follow them (Keras colocates each moment with its
variable), and with P x T > 1 `loss_and_grads` runs each stage's forward AND backward inside its
scope: one GradientTape per (stage, micro-batch), the backward handing each stage the gradient of
its output. (One tape over the whole forward would put every backward op wherever the
tape.gradient call happens to be placed: TF2's tape does not colocate gradients with their ops.)
So a stage's weights, gradients and moments sit on one device, which is what `tpu-llm plan`'s
per-stage memory assumes. The tied embedding table stays with the first stage; the head reads it.

On TPU the whole replica step is one XLA program and the stage boundaries are logical cores
(`experimental_logical_device`, which puts ops on `tpu.core(k)`) plus annotations on the tensors
crossing them. Off-TPU the stages run on their devices as a TF graph, not XLA: one XLA program
cannot span devices. The same schedule compiled as one program (no devices) is what a TPU runs; a
test compiles it.
"""

from __future__ import annotations

import dataclasses
import functools

import keras
import tensorflow as tf

from tpu_llm.config import ModelConfig
from tpu_llm.errors import UserError
from tpu_llm.model import spec
from tpu_llm.parallel.tensor import SplitBlock
from tpu_llm.platform import tf_compat


@dataclasses.dataclass(frozen=True)
class Stage:
    index: int
    blocks: tuple[int, ...]  # block indices, contiguous
    flops_per_token: float  # training (forward + backward) FLOPs per token
    params: int
    embed: bool = False  # holds the token (and gpt2's position) embeddings
    head: bool = False  # holds the final norm and the output head (untied: its own table)


def partition(cfg: ModelConfig, vocab_size: int, seq_len: int, stages: int) -> list[Stage]:
    """The P-stage partition that minimises the slowest stage's FLOPs (ties: the largest stage's params)."""
    n = cfg.n_layer
    if not 1 <= stages <= n:
        raise UserError(f"parallel.pipeline_stages={stages} must be between 1 and model.n_layer={n} "
                        "(each stage holds at least one block)")
    # training FLOPs per token and parameters (tpu_llm/model/spec.py): each block's; the embeddings (gpt2:
    # and positions); the final norm and an untied head's own table (tied: no new weights), and its matmul
    flops, params = spec.block_flops_per_token(cfg, seq_len), spec.block_params(cfg)
    embed_params = spec.embedding_params(cfg, vocab_size)
    head_flops, head_params = spec.head_flops_per_token(cfg, vocab_size), spec.head_params(cfg, vocab_size)

    def cost(first: int, last: int, index: int) -> tuple[float, int]:
        k = last - first
        f, p = k * flops, k * params
        if index == 0:
            p += embed_params
        if index == stages - 1:
            f, p = f + head_flops, p + head_params
        return f, p

    @functools.lru_cache(maxsize=None)
    def best(first: int, index: int) -> tuple[tuple[float, int], tuple[int, ...]]:
        """Best split of blocks[first:] into stages index..P-1: ((max flops, max params), cut points)."""
        if index == stages - 1:
            return cost(first, n, index), (n,)
        options = []
        for end in range(first + 1, n - (stages - 1 - index) + 1):  # leave a block for every later stage
            here = cost(first, end, index)
            rest, cuts = best(end, index + 1)
            options.append(((max(here[0], rest[0]), max(here[1], rest[1])), (end, *cuts)))
        return min(options)

    _, cuts = best(0, 0)
    out, first = [], 0
    for i, end in enumerate(cuts):
        f, p = cost(first, end, i)
        out.append(Stage(i, tuple(range(first, end)), f, p, embed=i == 0, head=i == stages - 1))
        first = end
    return out


def imbalance(stages: list[Stage]) -> float:
    """How much slower the slowest stage is than the mean, as a fraction (0 = perfectly balanced)."""
    mean = sum(s.flops_per_token for s in stages) / len(stages)
    return max(s.flops_per_token for s in stages) / mean - 1.0


def gpipe_bubble(stages: int, microbatches: int) -> float:
    """The fraction of a GPipe step each stage sits idle, for equal stages: (P-1)/(M+P-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def describe(stages: list[Stage]) -> list[str]:
    """The partition as printed at start-up: one line per stage, then the imbalance."""
    lines = []
    for s in stages:
        extra = " + embedding" * s.embed + " + head" * s.head
        lines.append(f"stage {s.index}: blocks {s.blocks[0]}-{s.blocks[-1]}{extra}; {s.params:,} params; "
                     f"{s.flops_per_token / 1e6:.2f} MFLOP/token")
    lines.append(f"imbalance {100 * imbalance(stages):.1f}% (slowest stage vs the mean)")
    return lines


def build_weights(model, stages: list[Stage], placement):
    """Create `model`'s variables stage by stage, each inside `placement.variables_at(layers=i)` (call inside the
    strategy scope); returns the model, built."""
    ids = tf.zeros([1, 1], tf.int32)
    for stage in stages:
        with placement.variables_at(layers=stage.index):
            x = model.embed(ids) if stage.embed else tf.zeros([1, 1, model.cfg.n_embd])
            for b in stage.blocks:
                x = model.blocks[b](x)[0]
            if stage.head:
                model.head(x)
            # Keras' Dropout made its seed variable in __init__, wherever the model was constructed (on
            # TPU: logical core 0); the stage that draws the masks keeps it
            if placement.spread:
                for layer in model.stage_layers(False, stage.blocks, False) + model.stage_layers(stage.embed, (), False):
                    _seeds_here(layer)  # (the blocks' first, then the embedding's: the order they always had)
    return model.build_weights()  # marks the model built: every variable exists already


def _seeds_here(layer) -> None:
    """Re-create the state variable of every dropout seed generator in `layer` in the current variable
    scope, with its value (a stage's placement.variables_at scope: the stage's device or logical core)."""
    for dropout in tf_compat.all_layers(layer):
        generator = getattr(dropout, "seed_generator", None)
        if not isinstance(dropout, keras.layers.Dropout) or generator is None:
            continue
        old = generator.state
        generator.state = keras.Variable(old.numpy(), shape=old.shape, dtype=old.dtype, trainable=False,
                                         aggregation="none", name=old.name)


def remat_with_dropout(run, layer):
    """tf.recompute_grad(run), whose recomputation draws the forward's dropout masks. Keras' Dropout draws
    each mask from its seed generator's state and advances it: re-run in the backward pass, it would draw
    new masks (and advance the state twice per step), differentiating another network. Here the
    generators' states are read once and handed to the recomputed function as arguments; inside it each
    generator's draws count up from that state as Keras' own would (a `fold(seed)` of the generator, such
    as the trainer's per-replica one, still applies) and write nothing; after the forward each state is
    advanced once per draw. Remat on and off draw the same masks."""
    generators = [d.seed_generator for d in tf_compat.all_layers(layer) if isinstance(d, keras.layers.Dropout)
                  and d.rate > 0 and getattr(d, "seed_generator", None) is not None]
    if not generators:
        return tf.recompute_grad(run)
    draws = [0] * len(generators)  # per generator: seeds drawn by the last trace of `replayed`

    def replayed(x, *states):
        for i, (generator, state) in enumerate(zip(generators, states)):
            draws[i] = 0

            def next_seed(ordered=True, i=i, generator=generator, state=state):
                seed = state + tf.constant([0, draws[i]], state.dtype)  # Keras: state, then state + [0, 1]
                draws[i] += 1
                return getattr(generator, "fold", lambda s: s)(seed)
            generator.next = next_seed  # (an instance attribute: the class's `next` is left alone)
        try:
            return run(x)
        finally:
            for generator in generators:
                del generator.next

    recomputed = tf.recompute_grad(replayed)

    def call(x):
        states = [tf.identity(generator.state.value) for generator in generators]
        y = recomputed(x, *states)
        for generator, state, n in zip(generators, states, draws):
            generator.state.assign(state + tf.constant([0, n], state.dtype))
        return y
    return call


def owning_stage(owner: dict, variable) -> int:
    """owner[id(variable)], the stage `variable` lives on. A variable no stage reads is a programming error
    (a layer missing from Pipeline.stage_variables, or a variable from another model): it is raised here,
    naming the variable, rather than sent to stage 0, where its gradient, norm and update would run on the
    first stage's device or core without anyone noticing."""
    try:
        return owner[id(variable)]
    except KeyError:
        name = getattr(variable, "path", None) or getattr(variable, "name", None) or repr(variable)
        raise LookupError(f"internal error: variable {name} belongs to no pipeline stage (the stages read "
                          f"{len(owner)} variables); every variable the step updates must be read by a stage "
                          "(Pipeline.stage_variables)") from None


class Pipeline:
    """The training forward pass of `model` as P placed stages over M micro-batches (P = M = 1: the
    plain forward pass, with optional rematerialisation)."""

    def __init__(self, model, stages: list[Stage], placement, microbatches: int = 1, remat: bool = False,
                 loss_chunk: int = 0):
        self.model, self.stages, self.placement = model, stages, placement
        self.microbatches = microbatches
        self.loss_chunk = loss_chunk  # train.loss_chunk: tokens per chunk of the head and loss (loss.py)
        # per stage: training -> its blocks' functions (split T ways with tensor parallelism)
        self.stage_fns = [self._stage_fn(stage, {training: [self._block_fn(b, stage.index, training, remat)
                                                             for b in stage.blocks] for training in (True, False)})
                          for stage in stages]

    def _block_fn(self, b: int, stage: int, training: bool, remat: bool):
        block = self.model.blocks[b]
        if self.placement.mesh.size_of("heads") > 1:
            run = SplitBlock(block, self.placement, stage, training)
        else:
            def run(x):
                return block(x, training=training)[0]
        # recompute_grad takes no keyword arguments in graph mode, hence one function per `training`
        return remat_with_dropout(run, block) if remat and training else run

    def _stage_fn(self, stage: Stage, blocks):
        model = self.model

        def run(x, targets, training):
            if stage.embed:
                x = model.embed(x, training=training)  # (b, T) token ids -> (b, T, C)
            for block in blocks[training]:
                x = block(x)
            if stage.head:  # the micro-batch's mean loss, float32 (train.loss_chunk: without the logits)
                return model.head_loss(x, targets, self.loss_chunk)
            return x  # (b, T, C), handed to the next stage's device
        return run

    @property
    def staged(self) -> bool:
        """More than one device or core per replica: gradients come from `loss_and_grads`."""
        return self.placement.spread

    def stage_variables(self, i: int) -> list:
        """The trainable variables stage i reads (a tied table twice: first and last stage)."""
        stage = self.stages[i]
        return [v for layer in self.model.stage_layers(stage.embed, stage.blocks, stage.head)
                for v in layer.trainable_variables]

    def variable_stages(self, variables) -> list[int]:
        """The stage each of `variables` lives on: the first stage that reads it, where build_weights
        created it (a tied table: the first stage's)."""
        owner: dict[int, int] = {}
        for i in range(len(self.stages)):
            for v in self.stage_variables(i):
                owner.setdefault(id(v), i)
        return [owning_stage(owner, v) for v in variables]

    def loss_and_grads(self, inputs, targets, variables, seed=None, watch: bool = False):
        """(mean loss, gradients of seed(mean loss) with respect to `variables`), with each stage's
        forward and backward inside its Placement scope. `seed` must be linear (the trainer's scaling
        by 1 / replicas and the loss scale); `watch`: also watch `v.value` (local SGD's per-replica
        variables are not trainable tf.Variables)."""
        m, seed = self.microbatches, seed or (lambda loss: loss)
        last = len(self.stage_fns) - 1
        own = [self.stage_variables(i) for i in range(last + 1)]
        tapes = []  # per micro-batch, per stage: (tape, stage input, what to differentiate)
        total = tf.constant(0.0)
        for x, y in zip(tf.split(inputs, m), tf.split(targets, m)):  # M x (B/M, T)
            chain = []
            for i, stage_fn in enumerate(self.stage_fns):
                with self.placement.at(layers=i), tf.GradientTape() as tape:
                    if watch:
                        tape.watch([v.value for v in own[i]])
                    if i:
                        tape.watch(x)
                    out = self.placement.place(stage_fn(x, y, True), layers=i)
                    target = seed(out / m) if i == last else out
                chain.append((tape, x, target))
                x = out
            total += x
            tapes.append(chain)
        index = {id(v): k for k, v in enumerate(variables)}
        grads = [None] * len(variables)
        for chain in reversed(tapes):  # last micro-batch first, as GPipe drains
            upstream = None
            for i in reversed(range(last + 1)):
                tape, x, target = chain[i]
                sources = own[i] + [x] * (i > 0)
                with self.placement.at(layers=i):
                    out = tape.gradient(target, sources, output_gradients=upstream)
                    for v, g in zip(own[i], out):
                        if g is None:  # not read by this stage (none today); zeros at the end if by none
                            continue
                        k, g = index[id(v)], tf.convert_to_tensor(g)  # embedding: IndexedSlices
                        grads[k] = g if grads[k] is None else grads[k] + g
                upstream = out[-1] if i else None
        return total / m, [g if g is not None else tf.zeros_like(v) for g, v in zip(grads, variables)]

    def loss(self, inputs, targets, training: bool = True):
        """Mean loss of the batch `inputs` (B, T) -> `targets` (B, T)."""
        m = self.microbatches
        xs, ys = tf.split(inputs, m), tf.split(targets, m)  # M x (B/M, T)
        total = tf.constant(0.0)
        for x, y in zip(xs, ys):
            for i, stage_fn in enumerate(self.stage_fns):
                with self.placement.at(layers=i):
                    x = self.placement.place(stage_fn(x, y, training), layers=i)
            total += x
        return total / m
