"""Building a run from its config: every check first (nothing is written until all passed), then its
compute (assemble.py: the model, optimizer, gradient exchange, stage pipeline and Trainer on the
strategy's mesh), the newest readable checkpoint and the input stream's position. controller.py drives
what this builds.
"""

from __future__ import annotations

import dataclasses
import os

import keras
import tensorflow as tf

from tpu_llm.config import Config
from tpu_llm.config.checks import trained_state
from tpu_llm.data import dataset as data
from tpu_llm.data import lanes, reading, sources
from tpu_llm.errors import UserError
from tpu_llm.model import GPT
from tpu_llm.parallel import comm, tpu
from tpu_llm.parallel.distribute import Distribution, get_strategy
from tpu_llm.platform.run_layout import check_run_tree
from tpu_llm.tokenizers import build_tokenizer, check_covers, load_tokenizer
from tpu_llm.tokenizers.hf import check_pretokenized
from tpu_llm.training import line_log, run_lock
from tpu_llm.training.assemble import assemble
from tpu_llm.training.checkpoint import Checkpointer, check_init_from, index_files, restore_init_from
from tpu_llm.training.run_directory import (check_run_dir, check_run_dir_owner, check_run_dir_reachable, record_run,
                                            resolve_tokenizer)
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
    # hf: shards only, on any platform
    check_pretokenized(cfg.data.tokenizer, (train_src, val_src), cfg.data.train, cfg.data.tokenizer_model)
    if dist.io_device:  # a remote TPU: its hosts tokenize, with core TF ops only

        tpu.check_remote_data(cfg, (train_src, val_src))
    check_run_dir_reachable(cfg.run_dir)  # before the tokenizer is looked for in it
    check_run_tree(cfg.run_dir)  # no link, FIFO or device in it: nothing read or written through one, by TF either
    if dist.is_chief:  # not another tool's directory (the other workers of a cluster write nothing) ...
        check_run_dir_owner(cfg.run_dir)
        run_lock.check_unlocked(cfg.run_dir)  # ... nor one another trainer is writing (its lock: taken below)
        line_log.check_logs(cfg.run_dir)  # its logs regular files of its own (no FIFO, no hard link elsewhere)
    tokenizer = setup_tokenizer(cfg, train_src, val_src)
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = tokenizer.vocab_size
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
                        f"{tokenizer.vocab_size} ids; set it to 0 (automatic) or >= {tokenizer.vocab_size}")
    if train_src.format == "tfrecord":  # the ids data prepare recorded, against the model's vocabulary
        reading.check_shard_ids([*train_src.files, *val_src.files], cfg.model.vocab_size)
    # Every check that can fail runs before anything in the run directory is written (record_run below)
    # and before the first step: the data holds a batch, the end-of-run prompt can be encoded.
    for source, split in zip((train_src, val_src), ("training", "validation")):
        sources.check_holds_a_batch(source, tokenizer, cfg.train.batch_size, cfg.data.seq_len, split)
    if cfg.sample.num_samples and cfg.sample.max_new_tokens:
        check_covers(tokenizer, cfg.sample.prompt, "sample.prompt")
    if dist.is_chief:
        check_run_dir(cfg, unstated)
    if cfg.train.init_from and not index_files(cfg.run_dir):  # a new run (a resume does not read init_from)
        check_init_from(cfg.train.init_from, cfg.model, tokenizer)
    return (train_src, val_src), tokenizer


def build_run(cfg: Config, dist: Distribution | None = None, unstated: str = "") -> Run:
    """`dist`: a distribution to reuse (tpu-llm doctor builds several runs on one TPU connection)."""
    dist = dist or get_strategy(cfg)  # first: it may split the CPU into logical devices or set up collectives
    (train_src, val_src), tokenizer = check_run(cfg, dist, unstated)
    set_precision(cfg, dist)
    tf.config.run_functions_eagerly(cfg.execution == "eager")
    compute = assemble(cfg, dist)
    model, optimizer, communication = compute.model, compute.optimizer, compute.comm
    # Resume: the newest readable checkpoint gives the weights, the optimizer (its step drives the
    # schedule), the dropout RNG state and the input stream's position, from which the training
    # data continues without being replayed (data.make_dataset_fn). A checkpoint without a position
    # (made by an earlier version) replays the stream to the restored step. Asynchronous workers
    # read in no fixed order, so they have no position to restore.
    rng = [v for v in model.variables if "seed_generator_state" in v.path]  # Keras does not checkpoint it
    scratch = "" if dist.is_chief else dist.task.replace(" ", "-")
    checkpointer = Checkpointer(cfg.run_dir, cfg.checkpoint.keep, scratch, cfg.checkpoint.keep_every_hours,
                                cluster=bool(dist.task or dist.asynchronous), io_device=dist.io_device,
                                model_config=cfg.model, tokenizer=tokenizer, trained=trained_state(cfg), model=model,
                                optimizer=optimizer,
                                rng=rng, **(communication.trackables() if communication else {}))
    # the chief holds the lock from before the newest checkpoint is read until train ends (Run.release, or
    # this process does): another trainer cannot save a checkpoint between that read and this run's writes
    created = run_lock.missing_directories(cfg.run_dir)  # a refusal below removes them again
    lock = run_lock.acquire(cfg.run_dir) if dist.is_chief else None
    try:
        resumed_from = checkpointer.restore_latest()  # a UserError if none of the checkpoints can be read
        initialised_from = None
        if resumed_from is None and cfg.train.init_from:  # a new run from another run's weights (fine-tuning)
            initialised_from = restore_init_from(cfg.train.init_from, cfg.model, model, tokenizer, dist.io_device)
        # every check passed: only now is the run directory written, by one writer at a time
        if lock is not None:
            checkpointer.lock = lock
            if lock.note:  # a stale gs:// lock taken over
                checkpointer.notes.append(lock.note)
            checkpointer.remove_unfinished()  # ckpt-N_temp/ of a save that was killed
            record_run(cfg, tokenizer)
        if communication:  # each replica's own residuals / weights, which a plain restore cannot give
            communication.restore(resumed_from)
        train_dataset, data_resume, position = _training_input(cfg, dist, tokenizer, train_src, checkpointer,
                                                                resumed_from, int(optimizer.iterations.numpy()))
        return Run(cfg, dist, tokenizer, model, optimizer, compute.trainer(position), iter(train_dataset),
                   _dataset(cfg, dist, tokenizer, val_src, training=False)[0], checkpointer, (train_src, val_src),
                   resumed_from, data_resume, communication, initialised_from, lock)
    except BaseException:
        if lock is not None:
            lock.release(created)
        raise


def _dataset(cfg: Config, dist: Distribution, tokenizer, source, training: bool, **resume):
    """(the distributed dataset, its function) of `source`."""
    # asynchronous workers must not share one seed (see data.make_dataset_fn)
    seed = None if dist.asynchronous and training else cfg.train.seed
    fn = data.make_dataset_fn(source, tokenizer, cfg.data.seq_len, cfg.train.batch_size,
                              training=training, seed=seed, shuffle_buffer=cfg.data.shuffle_buffer,
                              with_position=training and not dist.asynchronous, vocab_size=cfg.model.vocab_size,
                              **resume)
    return dist.distribute_dataset(fn), fn


def _training_input(cfg: Config, dist: Distribution, tokenizer, train_src, checkpointer: Checkpointer,
                    resumed_from: str | None, step: int):
    """The training batches from where the restored run left them: (the dataset, how the data position was
    restored, the position variable the steps write and the checkpoints save, None if asynchronous)."""
    start = checkpointer.read(resumed_from, "data_position") if resumed_from else None
    train_dataset, fn = _dataset(cfg, dist, tokenizer, train_src, True, start=start, skip_steps=step)
    data_resume = {"position": "data position restored", "replay": f"data stream replayed to step {step}",
                   "files": "the training files changed since the checkpoint: the data stream starts over on "
                            f"the {len(train_src.files)} files of data.train"}.get(fn.resumed, "")
    position = None
    if dist.asynchronous:
        data_resume = "asynchronous workers draw a new data order"
    else:  # each replica writes its pipeline's row; reading (and saving) sums them
        with dist.strategy.scope():
            position = tf.Variable(
                tf.zeros([fn.rows, len(lanes.POSITION_FIELDS)], tf.int64), trainable=False, name="data_position",
                synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM)
        checkpointer.add(data_position=position)
    return train_dataset, data_resume, position
