"""The training controller: builds a run from its config and drives it (Orbit's Controller role).

It owns everything between host calls: intervals, logging, TensorBoard summaries, evaluation,
checkpoints, resume, and the samples printed at the end. The compiled loops live in `trainer.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import keras
import tensorflow as tf

from tpu_llm import perf
from tpu_llm.config import Config
from tpu_llm.data import dataset as data
from tpu_llm.data import sources
from tpu_llm.errors import UserError
from tpu_llm.model import GPT
from tpu_llm.model.beam_search import BeamSearcher
from tpu_llm.model.sampling import Sampler, continuation
from tpu_llm.parallel import comm, pipeline, tpu
from tpu_llm.parallel.distribute import Distribution, get_strategy, serve_if_cluster_server
from tpu_llm.tokenizers import build_tokenizer, check_covers, load_tokenizer
from tpu_llm.tokenizers.hf import check_pretokenized
from tpu_llm.training import fault, goodput, run_lock
from tpu_llm.training import progress as phases
from tpu_llm.training.checkpoint import (LOGS_DIR, METRICS_FILE, Checkpointer, check_no_links, check_run_dir,
                                         check_run_dir_owner, check_run_dir_reachable, link_error, record_run,
                                         resolve_tokenizer, restore_init_from)
from tpu_llm.training.optimizer import freeze, make_optimizer
from tpu_llm.training.profiler import StepProfiler
from tpu_llm.training.line_log import LineLog
from tpu_llm.training.trainer import Trainer


@dataclasses.dataclass
class Run:
    """Everything a training run is made of, built by `build_run`."""

    cfg: Config
    dist: Distribution
    tokenizer: object
    model: GPT
    optimizer: object
    trainer: Trainer
    train_iterator: object
    val_dataset: object
    checkpointer: Checkpointer
    sources: tuple
    resumed_from: str | None
    data_resume: str  # how the data position was restored on resume
    comm: comm.Comm | None = None  # gradient compression or local SGD (None: the plain all-reduce)
    initialised_from: str | None = None  # train.init_from: the checkpoint whose weights a new run started from
    lock: run_lock.Handle | None = None  # the chief's: the run directory's writer lock, until `release`

    def release(self) -> None:
        """Let go of the run directory's lock (train does, at its end; a process's exit does too)."""
        if self.lock is not None:
            self.lock.release()


def setup_tokenizer(cfg: Config, train_src: sources.Source, val_src: sources.Source):
    """The run's saved tokenizer (checked against the data's) or a new one from the config."""
    saved = load_tokenizer(cfg.run_dir)
    if train_src.format == "tfrecord":
        shard_dir = os.path.dirname(train_src.files[0])
        fresh = load_tokenizer(shard_dir)
        if fresh is None:
            raise UserError(f"{shard_dir} has TFRecord shards but no tokenizer.json; write shards with "
                            "`tpu-llm data prepare`")
        if fresh.kind != cfg.data.tokenizer:
            raise UserError(f"the shards in {shard_dir} were made with the {fresh.kind} tokenizer; set "
                            f"data.tokenizer={fresh.kind}")
    elif saved is not None and cfg.data.tokenizer != "sentencepiece":
        fresh = None  # resuming: the run's own tokenizer is used (a char vocabulary is not rebuilt) ...
        if saved.kind == "char":  # ... if it covers this data: other characters would all become "unknown"
            missing = sorted(sources.text_characters(sorted(set(train_src.files) | set(val_src.files))) - set(saved.chars))
            if missing:
                shown = ", ".join(repr(c) for c in missing[:20]) + (", ..." if len(missing) > 20 else "")
                raise UserError(f"the char vocabulary saved in {cfg.run_dir!r} ({len(saved.chars)} characters) lacks "
                                f"{len(missing)} character(s) of this data: {shown}; train on the data it was built "
                                "from, or use another --run_dir")
    else:
        text_files = sorted(set(train_src.files) | set(val_src.files))
        fresh = build_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_model, text_files)
    return resolve_tokenizer(cfg.run_dir, saved, cfg.data.tokenizer, fresh)


def set_precision(cfg: Config, dist: Distribution) -> str:
    """Set Keras' global dtype policy for `cfg.precision` (auto: bfloat16 compute on TPU); returns it.
    Variables stay float32 under the mixed policies; logits, softmax and loss are float32 (model/transformer.py)."""
    precision = cfg.precision
    if precision == "auto":
        precision = "mixed_bfloat16" if dist.name == "tpu" else "float32"
    if precision == "mixed_float16" and dist.name == "tpu":  # TPUs compute in bfloat16, without loss scaling
        raise UserError("precision=mixed_float16 is for GPUs; a TPU computes in bfloat16: use "
                        "precision=mixed_bfloat16 (or auto, which picks it on a TPU)")
    keras.mixed_precision.set_global_policy(precision)
    return precision


def check_batch_split(batch_size: int, replicas: int, grad_accum: int, microbatches: int = 1) -> None:
    k = replicas * grad_accum * microbatches
    if batch_size % k:
        below, above = batch_size // k * k, (batch_size // k + 1) * k
        nearest = f"{below} or {above}" if below else str(above)
        pipe = f" x parallel.microbatches={microbatches}" if microbatches > 1 else ""
        raise UserError(f"train.batch_size={batch_size} does not split evenly into {replicas} replica(s) x "
                        f"train.grad_accum={grad_accum} micro-batches{pipe}; nearest valid values: {nearest}")


def check_run(cfg: Config, dist: Distribution, unstated: str = "") -> tuple[tuple, object]:
    """Every check of a run that needs no model: batch split, data, tokenizer against the data and the
    run directory (owner, lock, same model); writes nothing. Returns ((train, validation) sources,
    tokenizer). `unstated`: what the command line left to defaults (check_run_dir)."""
    check_batch_split(cfg.train.batch_size, dist.num_replicas, cfg.train.grad_accum, cfg.parallel.microbatches)
    keras.utils.set_random_seed(cfg.train.seed)
    train_src, val_src = sources.resolve_sources(cfg.data)
    check_pretokenized(cfg.data.tokenizer, (train_src, val_src))  # hf: shards only, on any platform
    if dist.io_device:  # a remote TPU: its hosts tokenize, with core TF ops only

        tpu.check_remote_data(cfg, (train_src, val_src))
    check_run_dir_reachable(cfg.run_dir)  # before the tokenizer is looked for in it
    check_no_links(cfg.run_dir)  # nothing in it is read or written through a symbolic link
    if dist.is_chief:  # not another tool's directory (the other workers of a cluster write nothing) ...
        check_run_dir_owner(cfg.run_dir)
        run_lock.check_unlocked(cfg.run_dir)  # ... nor one another trainer is writing (its lock: taken below)
    tokenizer = setup_tokenizer(cfg, train_src, val_src)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.vocab_size
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                        f"{tokenizer.vocab_size} ids; set it to 0 (automatic) or >= {tokenizer.vocab_size}")
    # Every check that can fail runs before anything in the run directory is written (record_run below)
    # and before the first step: the data holds a batch, the end-of-run prompt can be encoded.
    for source, split in zip((train_src, val_src), ("training", "validation")):
        sources.check_holds_a_batch(source, tokenizer, cfg.train.batch_size, cfg.data.seq_len, split)
    if cfg.sample.num_samples and cfg.sample.max_new_tokens:
        check_covers(tokenizer, cfg.sample.prompt, "sample.prompt")
    if dist.is_chief:
        check_run_dir(cfg, unstated)
    return (train_src, val_src), tokenizer


def build_run(cfg: Config, dist: Distribution | None = None, unstated: str = "") -> Run:
    """`dist`: a distribution to reuse (tpu-llm doctor builds several runs on one TPU connection)."""
    dist = dist or get_strategy(cfg)  # first: it may split the CPU into logical devices or set up collectives
    (train_src, val_src), tokenizer = check_run(cfg, dist, unstated)
    precision = set_precision(cfg, dist)
    tf.config.run_functions_eagerly(cfg.execution == "eager")
    local_sgd = comm.check(cfg.comm, dist)  # local SGD: per-replica copies of the weights and moments
    stages = pipeline.partition(cfg.model, cfg.model.vocab_size, cfg.data.seq_len, cfg.parallel.pipeline_stages)
    with dist.strategy.scope(), comm.variable_scope(local_sgd):
        # each stage's variables on its own device or logical TPU core (pipeline.build_weights)
        model = pipeline.build_weights(GPT(cfg.model, cfg.model.vocab_size), stages, dist.placement)
        freeze(cfg.train, model)  # fine-tuning: layers that stay as they are (train.freeze)
        optimizer = make_optimizer(cfg.train, model)
        if precision == "mixed_float16":  # float16 gradients underflow without a scaled loss
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
            optimizer.build(model.trainable_variables)
    with dist.strategy.scope():
        communication = comm.build(cfg.comm, dist, model, optimizer)

    def dataset(source, training, **resume):
        # asynchronous workers must not share one seed (see data.make_dataset_fn)
        seed = None if dist.asynchronous and training else cfg.train.seed
        fn = data.make_dataset_fn(source, tokenizer, cfg.data.seq_len, cfg.train.batch_size,
                                  training=training, seed=seed, shuffle_buffer=cfg.data.shuffle_buffer,
                                  with_position=training and not dist.asynchronous, **resume)
        return dist.distribute_dataset(fn), fn

    # Resume: the newest readable checkpoint gives the weights, the optimizer (its step drives the
    # schedule), the dropout RNG state and the input stream's position, from which the training
    # data continues without being replayed (data.make_dataset_fn). A checkpoint without a position
    # (made by an earlier version) replays the stream to the restored step. Asynchronous workers
    # read in no fixed order, so they have no position to restore.
    rng = [v for v in model.variables if "seed_generator_state" in v.path]  # Keras does not checkpoint it
    scratch = "" if dist.is_chief else dist.task.replace(" ", "-")
    checkpointer = Checkpointer(cfg.run_dir, cfg.checkpoint.keep, scratch, cfg.checkpoint.keep_every_hours,
                                cluster=bool(dist.task or dist.asynchronous), io_device=dist.io_device,
                                model_config=cfg.model, model=model, optimizer=optimizer, rng=rng,
                                **(communication.trackables() if communication else {}))
    resumed_from = checkpointer.restore_latest()  # a UserError if none of the checkpoints can be read
    initialised_from = None
    if resumed_from is None and cfg.train.init_from:  # a new run from another run's weights (fine-tuning)
        initialised_from = restore_init_from(cfg.train.init_from, cfg.model, model, tokenizer, dist.io_device)
    # every check passed: only now is the run directory written, by one writer at a time (the chief,
    # holding the lock until train ends, Run.release, or this process does)
    lock = run_lock.acquire(cfg.run_dir) if dist.is_chief else None
    try:
        if lock is not None:
            checkpointer.lock = lock
            if lock.note:  # a stale gs:// lock taken over
                checkpointer.notes.append(lock.note)
            checkpointer.remove_unfinished()  # ckpt-N_temp/ of a save that was killed
            record_run(cfg, tokenizer)
        if communication:  # each replica's own residuals / weights, which a plain restore cannot give
            communication.restore(resumed_from)
        step = int(optimizer.iterations.numpy())
        start = checkpointer.read(resumed_from, "data_position") if resumed_from else None
        train_dataset, fn = dataset(train_src, True, start=start, skip_steps=step)
        data_resume = {"position": "data position restored", "replay": f"data stream replayed to step {step}",
                       "files": "the training files changed since the checkpoint: the data stream starts over on "
                                f"the {len(train_src.files)} files of data.train"}.get(fn.resumed, "")
        position = None
        if dist.asynchronous:
            data_resume = "asynchronous workers draw a new data order"
        else:  # each replica writes its pipeline's row; reading (and saving) sums them
            with dist.strategy.scope():
                position = tf.Variable(
                    tf.zeros([fn.rows, len(data.POSITION_FIELDS)], tf.int64), trainable=False, name="data_position",
                    synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
            checkpointer.add(data_position=position)
        pipe = pipeline.Pipeline(model, stages, dist.placement, cfg.parallel.microbatches, cfg.parallel.remat,
                                 cfg.train.loss_chunk)
        trainer = Trainer(dist, model, optimizer, cfg.train, pipe, cfg.execution, communication, position)
        return Run(cfg, dist, tokenizer, model, optimizer, trainer, iter(train_dataset),
                   dataset(val_src, training=False)[0], checkpointer, (train_src, val_src), resumed_from,
                   data_resume, communication, initialised_from, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def say_now(text: str) -> None:
    """print, flushed: progress must show up as it happens when stdout is a pipe or a file."""
    print(text, flush=True)


class MetricsLog:
    """TensorBoard summaries plus metrics.jsonl in the run directory (chief only).

    Both hold one history, that of the steps the run's weights went through: a run resumed from (or
    rolled back to) step S first drops every entry past S (`truncate`), since those steps are done
    again, with other values after a rollback or a changed config. So no step is logged twice, and
    readers need no rule for duplicates. metrics.jsonl is rewritten atomically (a new file renamed
    over it); TensorBoard's event files are rewritten likewise, keeping the events up to S.
    """

    def __init__(self, run_dir: str, enabled: bool = True, resume_step: int | None = None, device: str = "",
                 lock: run_lock.Handle | None = None):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        self.logs = os.path.join(run_dir, LOGS_DIR)
        self.enabled, self.writers, self.lock = enabled, {}, lock
        self.out = LineLog(run_dir, METRICS_FILE, lock.check if lock else None)  # on gs://: in batches
        # a remote TPU: the writers (and their ops) on this process, not on the TPU host (tpu.CLIENT_IO)
        self.device = device
        if enabled:  # TF's summary writers follow links: none under logs/ (nor at metrics.jsonl)
            check_no_links(run_dir)
        self.dropped = self.truncate(resume_step) if enabled and resume_step is not None else 0
        with tf.device(device or None):
            self.writers = {split: tf.summary.create_file_writer(os.path.join(run_dir, "logs", split))
                            for split in ("train", "validation", "goodput")} if enabled else {}

    def truncate(self, step: int) -> int:
        """Drop the entries logged after `step` from metrics.jsonl and the event files; returns how
        many metrics.jsonl lines went."""
        if not self.enabled:
            return 0
        self.flush()
        check_no_links(self.run_dir)  # it rewrites metrics.jsonl and the event files
        dropped = 0
        if tf.io.gfile.exists(self.path):
            with tf.io.gfile.GFile(self.path) as f:
                lines = f.read().splitlines(keepends=True)
            kept = [line for line in lines if _logged_step(line) is not None and _logged_step(line) <= step]
            if len(kept) < len(lines):  # (a line torn by a kill mid-write goes too)
                dropped = len(lines) - len(kept)
                _replace(self.path, lambda f: f.write("".join(kept)))
        for path in tf.io.gfile.glob(os.path.join(self.logs, "*", "events.out.tfevents.*")):
            _truncate_events(path, step)
        return dropped

    def write(self, split: str, step: int, values: dict) -> None:
        if not self.enabled:
            return
        if self.lock is not None:  # a run that lost its lock writes no more
            self.lock.check()
        if "://" not in self.run_dir:  # the writers' files are open already: their directories, three lstat calls
            for rel in (LOGS_DIR, *(os.path.join(LOGS_DIR, s) for s in self.writers)):
                if os.path.islink(os.path.join(self.run_dir, rel)):
                    raise link_error(self.run_dir, rel)
        if split in self.writers:  # the end-of-run summary goes to metrics.jsonl only
            with tf.device(self.device or None), self.writers[split].as_default(step=step):
                for key, value in values.items():
                    tf.summary.scalar(key, value)
        self.out.append(json.dumps({"split": split, "step": step, **values}) + "\n")
        if split == "summary":  # the run's last line (on gs://, at once)
            self.out.flush()

    def flush(self) -> None:
        self.out.flush()
        with tf.device(self.device or None):
            for w in self.writers.values():
                w.flush()


def _logged_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _replace(path: str, write) -> None:
    """Write `path` anew through a temporary file renamed over it: a kill leaves the old or the new file."""
    tmp = f"{path}.tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        write(f)
    tf.io.gfile.rename(tmp, path, overwrite=True)


def _truncate_events(path: str, step: int) -> None:
    """Rewrite a TensorBoard event file without its events after `step` (if it has any)."""
    kept, changed = [], False
    try:
        for event in tf.compat.v1.train.summary_iterator(path):
            if event.step > step:
                changed = True
            else:
                kept.append(event.SerializeToString())
    except tf.errors.DataLossError:  # a record torn by a kill mid-write
        changed = True
    if changed:
        tmp = f"{path}.tmp"
        with tf.io.TFRecordWriter(tmp) as writer:
            for record in kept:
                writer.write(record)
        tf.io.gfile.rename(tmp, path, overwrite=True)


def evaluate(run: Run) -> float:
    iterator = iter(run.val_dataset)
    try:
        return run.trainer.evaluate(iterator, run.cfg.train.eval_steps)
    except tf.errors.OutOfRangeError:
        raise UserError(f"validation data ({run.sources[1].description}) holds less than one batch of "
                        f"{run.cfg.train.batch_size} x {run.cfg.data.seq_len + 1} tokens; add data or lower "
                        "train.batch_size / data.seq_len") from None


def out_of_memory(error: tf.errors.ResourceExhaustedError, run: Run, step: int, doing: str = "training") -> UserError:
    """The one line for a step that did not fit in device memory (XLA's own error is a page of HLO).

    Raised straight from the failed call: the guard saves nothing on the way out, so the newest
    checkpoint stays the last one written before it, and no half-updated state is saved."""
    cfg = run.cfg
    first = (str(getattr(error, "message", "") or error).strip().splitlines() or [""])[0][:160]
    remat = "" if cfg.parallel.remat else ", set parallel.remat=true (recomputes activations)"
    latest = run.checkpointer.latest
    kept = f"the newest checkpoint, {latest}, is unchanged" if latest else "no checkpoint was saved yet"
    return UserError(f"out of device memory {doing} at step {step} ({type(error).__name__}: {first}); lower "
                     f"train.batch_size={cfg.train.batch_size} (or raise train.grad_accum={cfg.train.grad_accum}) or "
                     f"data.seq_len={cfg.data.seq_len}{remat}, and check the fit first with `tpu-llm plan "
                     f"--accelerator ...`; {kept}")


def setup_lines(cfg: Config, dist: Distribution, srcs, tokenizer) -> list[str]:
    """The header's first lines: run directory, strategy, data and tokenizer (train and --dry_run)."""
    xla = dist.xla if cfg.execution == "xla" else f"off (execution={cfg.execution})"
    return [f"run_dir   {cfg.run_dir}",
            f"strategy  {dist.name} ({dist.reason}); {dist.num_replicas} replica(s)"
            + (f" per step, {dist.num_workers} workers" if dist.asynchronous else "") + f"; XLA: {xla}",
            f"data      train: {srcs[0].description}; validation: {srcs[1].description}",
            f"tokenizer {tokenizer.kind}, {tokenizer.vocab_size} ids"]


def layout_lines(cfg: Config, dist: Distribution, stages) -> list[str]:
    """The header's pipeline lines (with the run's `stages`) or tensor line (train and --dry_run)."""
    p = cfg.parallel
    if p.pipeline_stages > 1:
        return [f"pipeline  GPipe, {p.pipeline_stages} stages x {p.microbatches} micro-batches (bubble "
                f"{pipeline.gpipe_bubble(p.pipeline_stages, p.microbatches):.0%}){', remat' if p.remat else ''}; "
                f"{dist.placement.describe()}"] + [f"          {line}" for line in pipeline.describe(stages)]
    if p.tensor > 1:
        return [f"tensor    heads and MLP units split {p.tensor} ways; {dist.placement.describe()}"]
    return []


def describe_run(run: Run, step: int, peak: float, peak_how: str) -> list[str]:
    """The start-up header of a run: where it writes, how it is distributed, its data, model and batch,
    and where it starts (resumed, initialised from another run, or new)."""
    cfg, t, d, dist = run.cfg, run.cfg.train, run.cfg.data, run.dist
    lines = setup_lines(cfg, dist, run.sources, run.tokenizer) + [
        f"precision {keras.mixed_precision.global_policy().name}; execution {cfg.execution}"]
    stages = run.trainer.pipeline.stages if cfg.parallel.pipeline_stages > 1 else None
    lines += layout_lines(cfg, dist, stages)
    if run.comm:
        lines.append(f"comm      {run.comm.describe()}")
    elif comm.active(cfg.comm):
        lines.append("comm      off: one replica, nothing to exchange")
    m = cfg.model
    frozen = f"; frozen: {phases.frozen_layers(t.freeze, m.n_layer)}" if t.freeze else ""
    lines += [f"model     {phases.parameters_text(run.model)} ({m.family}: {m.n_layer} layers, {m.n_head} heads, width "
              f"{m.n_embd}{frozen}); {perf.format_count(run.model.flops_per_token(d.seq_len))}FLOP/token",
              f"batch     {t.batch_size} x {d.seq_len} tokens = {t.batch_size * d.seq_len:,} per step; "
              f"{t.steps_per_loop} steps per host call; MFU peak: {perf.format_count(peak)}FLOP/s ({peak_how})"]
    # e.g. an unreadable newest checkpoint skipped for the previous one
    lines += [f"warning   {note}" for note in run.checkpointer.notes]
    if run.resumed_from:
        lines.append(f"resumed   from {run.resumed_from} at step {step} ({run.data_resume})")
    elif run.initialised_from:
        lines.append(f"weights   from {run.initialised_from} (train.init_from); a fresh optimizer at step 0")
    return lines


def _next_boundary(step: int, every: int, total: int) -> int:
    return min(total, (step // every + 1) * every) if every > 0 else total


def train(cfg: Config, say=None, samples: bool = True, started: float | None = None, unstated: str = "") -> dict:
    """Train `cfg` to `cfg.train.steps` (resuming from its run directory); returns a summary. `started`:
    the Unix time this run's wall time counts from (goodput.py; `tpu-llm train`: its process's start);
    `unstated`: what the command left out (no --config, no --run_dir), named if the run directory refuses."""
    if serve_if_cluster_server(cfg):  # a parameter-server cluster's worker or ps task: serves, never returns
        return {}
    say = say or say_now
    started = started or time.time()
    say(phases.STARTING)
    run = build_run(cfg, unstated=unstated)
    ledger = goodput.Ledger(cfg.run_dir, started, run.dist.is_chief, run.lock)
    try:
        return _train(run, say, samples, ledger)
    finally:
        ledger.close()  # (a killed process writes no end: the next one accounts for it)
        run.release()  # the run directory's lock (the process's end would release it too)


def _train(run: Run, say, samples: bool, ledger: goodput.Ledger) -> dict:
    cfg = run.cfg
    tell = say  # the lines every process prints, chief or not
    if not run.dist.is_chief:  # the chief prints and logs for the whole cluster
        say(f"worker    {run.dist.task}: training in step with the chief, which prints the progress")
        say = _quiet
    t, d = cfg.train, cfg.data
    step = int(run.optimizer.iterations.numpy())
    tokens_per_step = t.batch_size * d.seq_len
    flops_per_token = run.model.flops_per_token(d.seq_len)
    peak, peak_how = run.dist.peak_flops(
        lambda: say("starting  measuring the MFU peak (once per machine: a float32 matmul, a few seconds) ..."))

    for line in describe_run(run, step, peak, peak_how):
        say(line)
    if step >= t.steps:
        say(f"nothing to do: the run is already at step {step} of train.steps={t.steps}")

    log = MetricsLog(cfg.run_dir, enabled=run.dist.is_chief, resume_step=step,
                     device=run.dist.io_device, lock=run.lock)  # drops entries past `step`
    if log.dropped:
        say(f"metrics   dropped {log.dropped} entries logged after step {step} (metrics.jsonl and TensorBoard): "
            "the steps after the checkpoint are done again")
    progress = perf.Progress(t.steps, initial=step, label="step ", quiet=not run.dist.is_chief)
    profiler = StepProfiler(t.profile_steps, cfg.run_dir, t.steps, trace=run.dist.is_chief)  # cuts calls on every worker
    if profiler.missed(step):
        say(f"profile   train.profile_steps={t.profile_steps} was done before step {step}: no trace this time")
    timings = []  # (steps, seconds) of each call
    eta, eval_phase = phases.Eta(), phases.EvalPhase()
    last = {"loss": float("nan")}
    val_loss = None
    ledger.start(step)  # the start-up ends here (goodput.py)
    with fault.Guard(run, say, log) as guard:  # signals, non-finite steps, lost tasks, time-based saves
        try:
            while step < t.steps:
                end = min(step + t.steps_per_loop * run.dist.loops_per_call(),
                          _next_boundary(step, t.eval_every, t.steps),
                          _next_boundary(step, cfg.checkpoint.every_steps, t.steps), profiler.boundary(step))
                profiler.before_call(step)
                if not timings:
                    say(phases.compile_line(cfg.execution, run.dist.jit_compile, end - step))
                start = time.perf_counter()
                try:  # waits for the steps; a signal may end the call early (out["steps"] < end - step)
                    out = guard.call(lambda: run.trainer.run(run.train_iterator, end - step, t.steps_per_loop))
                except tf.errors.OutOfRangeError:
                    raise UserError(f"training data ({run.sources[0].description}) holds less than one batch of "
                                    f"{t.batch_size} x {d.seq_len + 1} tokens; add data or lower train.batch_size "
                                    "/ data.seq_len") from None
                except tf.errors.ResourceExhaustedError as e:  # nothing of this call is saved
                    raise out_of_memory(e, run, step) from None
                except tf.errors.DataLossError as e:  # a damaged shard: one line naming it (nothing saved)
                    raise sources.corrupt_record(e, run.sources[0], "training", True, run.checkpointer.latest) from None
                n = out["steps"]
                ledger.steps(step, n, time.perf_counter() - start)
                if n:
                    loss, grad_norm = out["loss"], out["grad_norm"]
                    seconds = time.perf_counter() - start
                    step += n
                    if not timings:
                        say(phases.compiled_line(seconds, n))
                    timings.append((n, seconds))
                    eta.record(n, seconds)
                    tok_s = n * tokens_per_step / seconds
                    mfu = tok_s * flops_per_token / peak
                    lr = float(run.optimizer.learning_rate)
                    last = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tok_s, "mfu": mfu,
                            "ms_per_step": 1000 * seconds / n}
                    stale = ""
                    if run.dist.asynchronous:  # updates by other workers between a step's read and its write
                        last.update(staleness=out["staleness"], staleness_max=out["staleness_max"])
                        stale = f" | stale {out['staleness']:.1f} (max {out['staleness_max']:.0f})"
                    log.write("train", step, last)
                    progress.update(step, f"loss {loss:.4f} | lr {lr:.2e} | gnorm {grad_norm:.2f} | "
                                          f"{perf.format_count(tok_s)} tok/s | MFU {100 * mfu:.1f}%{stale}",
                                    eta=eta.seconds_left(t.steps - step))
                    step = guard.after_call(out, step)
                if profiler.stops_at(step):
                    with ledger.timed("profiling", step):
                        trace = profiler.stop()
                    say(f"profile   steps {t.profile_steps} traced: {trace} (tensorboard --logdir {cfg.run_dir}/logs)")
                boundary = step == end  # all steps asked for were done (no signal, no rollback)
                if boundary and step == t.steps:  # local SGD: the final model is the synchronised one
                    run.trainer.synchronise()
                if boundary and (step == t.steps or (t.eval_every and step % t.eval_every == 0)):
                    if line := eval_phase.line(t.eval_steps):
                        progress.message(line)
                    began = time.perf_counter()
                    try:
                        with ledger.timed("evaluation", step):
                            val_loss = evaluate(run)
                    except tf.errors.ResourceExhaustedError as e:
                        raise out_of_memory(e, run, step, "evaluating") from None
                    except tf.errors.DataLossError as e:
                        raise sources.corrupt_record(e, run.sources[1], "validation", True,
                                                     run.checkpointer.latest) from None
                    eval_phase.took(time.perf_counter() - began)
                    log.write("validation", step, {"loss": val_loss})
                    progress.message(f"eval      step {step}: validation loss {val_loss:.4f}")
                due = boundary and (step == t.steps or bool(
                    cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0))
                with ledger.timed("checkpoint", step):
                    guard.checkpoint(step, due=due)
                if due:  # goodput so far, with each saved step (metrics.jsonl and TensorBoard)
                    log.write("goodput", step, goodput.metrics(ledger.figures()))
                    log.flush()  # (on gs://, the lines held since the last save go out now)
                    ledger.flush()
        finally:
            profiler.close()
            progress.close()
            log.flush()
            ledger.flush()

    summary = {"step": step, "train_loss": last["loss"], "val_loss": val_loss, "tokens_per_sec": None,
               "ms_per_step": None, "params": run.model.num_params(), "run_dir": cfg.run_dir,
               "strategy": run.dist.name, "replicas": run.dist.num_replicas}
    if run.dist.asynchronous:
        summary.update(staleness=last.get("staleness"), staleness_max=last.get("staleness_max"))
    if run.comm:
        summary.update(run.comm.metrics())
    if timings:
        timed = timings[1:] or timings  # the first call includes tracing and XLA compilation
        timed_steps, timed_seconds = sum(n for n, _ in timed), sum(sec for _, sec in timed)
        summary.update(tokens_per_sec=timed_steps * tokens_per_step / timed_seconds,
                       ms_per_step=1000 * timed_seconds / timed_steps)
        summary["mfu"] = summary["tokens_per_sec"] * flops_per_token / peak
        say(f"done      step {step}: train loss {last['loss']:.4f}"
            + (f", validation loss {val_loss:.4f}" if val_loss is not None else "")
            + f"; {perf.format_count(summary['tokens_per_sec'])} tok/s, {summary['ms_per_step']:.1f} ms/step, "
              f"MFU {100 * summary['mfu']:.1f}% "
            + ("(after the first, compiling, call)" if len(timings) > 1 else "(one call, compilation included)")
            + f"; {goodput.summary(ledger.figures())}")
        if summary["mfu"] > 1 and run.dist.is_chief:  # more than the peak: the peak was measured low
            old = run.dist.raise_peak(summary["mfu"] * peak)
            if old:
                say(f"peak      this run reached {perf.format_count(summary['mfu'] * peak)}FLOP/s, above the MFU peak of "
                    f"{perf.format_count(old)}FLOP/s measured on a busy machine: the cache holds the higher one now")
    # equal on every worker of a synchronous cluster: a check that they trained the same model
    summary["fingerprint"] = weights_fingerprint(run.model)
    if run.dist.task:
        tell(f"weights   {run.dist.task} at step {step}: fingerprint {summary['fingerprint']}")
    if timings:
        log.write("summary", step, {k: v for k, v in summary.items() if k != "run_dir"})
    if samples and run.dist.is_chief and cfg.sample.num_samples and cfg.sample.max_new_tokens:
        say(phases.sampling_line(cfg.sample.num_samples, cfg.sample.max_new_tokens))
        with ledger.timed("sampling", step):
            print_samples(local_copy(run.model, cfg), run.tokenizer, cfg, say)
    return summary


def weights_fingerprint(model: GPT) -> str:
    digest = hashlib.sha256()
    for array in model.get_weights():
        digest.update(array.tobytes())
    return digest.hexdigest()[:16]


def local_copy(model: GPT, cfg: Config) -> GPT:
    """The model's weights in a model of this process's default device, outside any strategy: sampling
    needs no replicas, and variables on ps tasks or TPU cores cannot be read by a host-compiled step."""
    copy = GPT(cfg.model, cfg.model.vocab_size).build_weights()
    copy.set_weights(model.get_weights())
    return copy


def _quiet(*_) -> None:
    pass


def print_samples(model: GPT, tokenizer, cfg: Config, say=None) -> list[str]:
    say, s = say or say_now, cfg.sample
    if s.num_beams > 1:
        return print_beams(model, tokenizer, cfg, say)
    sampler = Sampler(model, tokenizer.eos_id, tokenizer.vocab_size)
    prompt = tokenizer.encode(s.prompt)  # "" gives [] (or an hf tokenizer's BOS)
    texts = []
    for i in range(s.num_samples):
        ids = sampler.generate(prompt, s.max_new_tokens, s.temperature, s.top_k, s.top_p, seed=s.seed + i)
        texts.append(s.prompt + continuation(tokenizer, prompt, ids))
        say(f"--- sample {i + 1} (temperature {s.temperature}, top_k {s.top_k}, top_p {s.top_p}, "
            f"seed {s.seed + i})")
        say(texts[-1])
    return texts


def print_beams(model: GPT, tokenizer, cfg: Config, say) -> list[str]:
    """sample.num_return_sequences texts from a beam search (each without its final end-of-text)."""
    s = cfg.sample
    prompt = tokenizer.encode(s.prompt)
    beams = BeamSearcher(model, tokenizer.eos_id, tokenizer.vocab_size).generate(
        prompt, s.max_new_tokens, s.num_beams, s.length_penalty, s.early_stopping, s.num_return_sequences)
    texts = []
    for i, beam in enumerate(beams):
        ids = beam.ids[:-1] if beam.ids[-1] == tokenizer.eos_id else beam.ids
        texts.append(s.prompt + continuation(tokenizer, prompt, ids))
        say(f"--- beam {i + 1} of {s.num_beams} (score {beam.score:.4f}, length_penalty {s.length_penalty}, "
            f"early_stopping {s.early_stopping})")
        say(texts[-1])
    return texts
