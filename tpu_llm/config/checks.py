"""The checks of a run configuration's values (`validate`): each bad value a one-line UserError naming the
key, the valid choices and the fix; the caps first, so that no later check loops over, allocates or
prints a size from outside unchecked, and no message is built unless its check fails. A model section's
family-specific checks are its family's (model/families/).
"""

from __future__ import annotations

import dataclasses
import re
import shlex

from tpu_llm.config.reading import REPR
from tpu_llm.config.reading import check as _check
from tpu_llm.config.schema import (ATTENTIONS, BAD_STEP_ACTIONS, CAPS, COMMUNICATIONS, COMPRESSIONS, DATA_FORMATS,
                                   EARLY_STOPPING, EXECUTIONS, INT64, MAX_BEAMS, MAX_LENGTH_PENALTY, MAX_PARAMS,
                                   OUTER_OPTIMIZERS, PRECISIONS, SCHEDULES, SHARD_OPTIMIZER, STRATEGIES, TOKENIZERS,
                                   CommConfig, Config, ModelConfig, SampleConfig, TrainConfig)
from tpu_llm.errors import UserError
from tpu_llm.model import families, spec
from tpu_llm.model.families.base import divisors as _divisors


def approx_params(m: ModelConfig) -> int:
    """The parameters of the model section `m`, from its sizes alone (norms and biases left out): what
    MAX_PARAMS bounds. vocab_size 0 (the tokenizer's) counts no table."""
    return spec.matrix_params(m, m.vocab_size)


def _validate_caps(cfg: Config) -> None:
    for key, (cap, why) in CAPS.items():
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        _check(value <= cap, lambda: f"{key}={value if len(str(value)) <= 30 else f'a {len(str(value))}-digit number'} "
                                     f"is more than its cap of {cap:,} ({why})")


def validate(cfg: Config) -> None:
    """A UserError naming the first value that is out of range or inconsistent with another (the caps first)."""
    m, d, t, c, s = cfg.model, cfg.data, cfg.train, cfg.checkpoint, cfg.sample
    _validate_caps(cfg)  # first: every later check may loop over, or print, these sizes
    _validate_no_nul(cfg)
    _check(m.family in families.NAMES, f"model.family={m.family!r}; valid choices: {', '.join(families.NAMES)}")
    _validate_run(cfg)
    _validate_comm(cfg)
    _validate_model(m)
    _check(t.loss_chunk >= 0, f"train.loss_chunk={t.loss_chunk} must be >= 0 (0 = off)")
    _check(d.tokenizer in TOKENIZERS,
           f"data.tokenizer={d.tokenizer!r}; valid choices: {', '.join(TOKENIZERS)}")
    _check(d.format in DATA_FORMATS,
           f"data.format={d.format!r}; valid choices: {', '.join(DATA_FORMATS)}")
    _check(d.tokenizer != "sentencepiece" or bool(d.tokenizer_model),
           "data.tokenizer=sentencepiece needs data.tokenizer_model=PATH.model "
           "(make one with `tpu-llm tokenizer train`)")
    _check(d.seq_len >= 1, f"data.seq_len={d.seq_len} must be >= 1")
    _check(d.seq_len <= m.max_len,
           f"data.seq_len={d.seq_len} exceeds model.max_len={m.max_len}; "
           f"lower data.seq_len or raise model.max_len")
    _check(0.0 < d.validation_fraction < 1.0,
           f"data.validation_fraction={d.validation_fraction} must be in (0, 1)")
    _check(d.shuffle_buffer >= 1, f"data.shuffle_buffer={d.shuffle_buffer} must be >= 1")
    for name in ("steps", "batch_size", "grad_accum", "steps_per_loop", "eval_steps"):
        _check(getattr(t, name) >= 1, f"train.{name}={getattr(t, name)} must be >= 1")
    _check(t.batch_size % t.grad_accum == 0,
           lambda: f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}; "
                   f"valid grad_accum values: {_divisors(t.batch_size)}")
    for name in ("warmup_steps", "decay_steps", "eval_every", "eval_tasks_every", "eval_tasks_limit"):
        _check(getattr(t, name) >= 0, f"train.{name}={getattr(t, name)} must be >= 0")
    _check(t.lr > 0 and 0 <= t.min_lr <= t.lr, f"need 0 <= train.min_lr ({t.min_lr}) <= train.lr ({t.lr}), lr > 0")
    _check(0 <= t.beta1 < 1 and 0 <= t.beta2 < 1, "train.beta1 and train.beta2 must be in [0, 1)")
    _check(t.weight_decay >= 0 and t.clip_norm >= 0, "train.weight_decay and train.clip_norm must be >= 0")
    _check(c.every_steps >= 0 and c.keep >= 1,
           f"checkpoint.every_steps ({c.every_steps}) must be >= 0 and checkpoint.keep ({c.keep}) >= 1")
    _check(c.every_minutes >= 0 and c.keep_every_hours >= 0,
           f"checkpoint.every_minutes ({c.every_minutes}) and checkpoint.keep_every_hours "
           f"({c.keep_every_hours}) must be >= 0 (0 = off)")
    _check(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    _check(t.max_bad_steps >= 0, f"train.max_bad_steps={t.max_bad_steps} must be >= 0 (0 = stop at the first)")
    spec.frozen_layers(t.freeze, m.n_layer)
    validate_lora(cfg)
    _validate_eval_tasks(t)
    profile_range(t.profile_steps, t.steps)
    _check(t.on_bad_step in BAD_STEP_ACTIONS,
           f"train.on_bad_step={t.on_bad_step!r}; valid choices: {', '.join(BAD_STEP_ACTIONS)}")
    _check(s.temperature >= 0, f"sample.temperature={s.temperature} must be >= 0 (0 = greedy)")
    _check(0 < s.top_p <= 1, f"sample.top_p={s.top_p} must be in (0, 1]")
    _check(s.top_k >= 0 and s.max_new_tokens >= 0 and s.num_samples >= 0,
           "sample.top_k, sample.max_new_tokens and sample.num_samples must be >= 0")
    _check(s.seed >= -INT64, f"sample.seed={s.seed} must be >= -2**63 (a 64-bit seed)")
    _validate_beams(s)



def _validate_eval_tasks(t: TrainConfig) -> None:
    """What needs neither lm-eval nor the disk. The include path's folder and the task names are checked when
    the run starts (eval/in_loop.py): a saved config is validated too whenever its run loads, and a run
    copied elsewhere must still load where the folder is missing."""
    _check(t.eval_tasks != "" or not t.eval_include_path,
           lambda: f"train.eval_include_path={t.eval_include_path!r} is set but train.eval_tasks is empty; name "
                   "the tasks to run (e.g. train.eval_tasks=my_task), or drop the path")


def _validate_no_nul(cfg: Config) -> None:
    """No text value holds a NUL byte: run_dir, train.init_from, data.train are paths, and os.stat raises
    ValueError on one (a traceback); a YAML config ("\\0") or the Python API can give one."""
    sections = [("", cfg)] + [(f"{name}.", v) for name, v in vars(cfg).items() if dataclasses.is_dataclass(v)]
    for prefix, section in sections:
        for key, value in vars(section).items():
            _check(not (isinstance(value, str) and "\0" in value),
                   lambda: f"{prefix}{key}={ascii(value)[:80]} holds a NUL byte, which no path or name may hold")


def _validate_beams(s: SampleConfig) -> None:
    _check(1 <= s.num_beams <= MAX_BEAMS, f"sample.num_beams={s.num_beams} must be between 1 (off) and {MAX_BEAMS} "
                                          "(each beam is a row of the KV cache)")
    _check(abs(s.length_penalty) <= MAX_LENGTH_PENALTY,  # NaN fails too
           f"sample.length_penalty={s.length_penalty} must be between -{MAX_LENGTH_PENALTY:g} and "
           f"{MAX_LENGTH_PENALTY:g} (length ** it must stay finite; 1.0 = the mean log-probability)")
    _check(s.early_stopping in EARLY_STOPPING,
           f"sample.early_stopping={REPR.repr(s.early_stopping)}; valid choices: {', '.join(EARLY_STOPPING)}")
    _check(1 <= s.num_return_sequences <= s.num_beams,
           f"sample.num_return_sequences={s.num_return_sequences} must be between 1 and sample.num_beams="
           f"{s.num_beams}: the best of the beams are returned")
    if s.num_beams > 1:  # transformers' beam search with do_sample=False; beam sampling is not supported
        _check(s.temperature == 0, f"sample.num_beams={s.num_beams} searches greedily: set sample.temperature=0 "
                                   f"(not {s.temperature}; beam sampling is not supported)")
        _check(s.num_samples <= 1, f"sample.num_samples={s.num_samples} with sample.num_beams={s.num_beams}: beam "
                                   "search is deterministic, every sample would be the same; set "
                                   "sample.num_samples=1 and sample.num_return_sequences for several beams")


def _validate_run(cfg: Config) -> None:
    """The strategy, the devices and the parallel layout."""
    _check(cfg.strategy in STRATEGIES,
           f"strategy={cfg.strategy!r}; valid choices: {', '.join(STRATEGIES)}")
    _check(bool(cfg.run_dir), "run_dir is empty; give a local path or gs://bucket/path")
    _check(cfg.cpu_devices >= 1, f"cpu_devices={cfg.cpu_devices} must be >= 1")
    _check(cfg.cpu_devices <= cfg.parallel.pipeline_stages or cfg.strategy in ("auto", "mirrored"),
           f"cpu_devices={cfg.cpu_devices} splits one CPU for strategy=mirrored (or auto); "
           f"strategy={cfg.strategy} runs one device per process, so drop cpu_devices")
    _check(cfg.cluster.communication in COMMUNICATIONS,
           f"cluster.communication={cfg.cluster.communication!r}; valid choices: {', '.join(COMMUNICATIONS)}")
    p = cfg.parallel
    _check(cfg.precision in PRECISIONS, f"precision={cfg.precision!r}; valid choices: {', '.join(PRECISIONS)}")
    _check(cfg.execution in EXECUTIONS, f"execution={cfg.execution!r}; valid choices: {', '.join(EXECUTIONS)}")
    _check(p.schedule in SCHEDULES,
           f"parallel.schedule={p.schedule!r}; valid choices: {', '.join(SCHEDULES)} (1F1B cannot be ordered in "
           "TensorFlow's dataflow graph: see docs/pipeline-tensor.md)")
    _check(1 <= p.pipeline_stages <= cfg.model.n_layer,
           f"parallel.pipeline_stages={p.pipeline_stages} must be between 1 and model.n_layer={cfg.model.n_layer}")
    _check(p.microbatches >= 1 and p.tensor >= 1, "parallel.microbatches and parallel.tensor must be >= 1")
    _check(p.tensor == 1 or cfg.model.n_head % p.tensor == 0,
           lambda: f"parallel.tensor={p.tensor} must divide model.n_head={cfg.model.n_head} (each device takes "
                   f"whole attention heads); valid values: {_divisors(cfg.model.n_head)}")
    kv = cfg.model.kv_heads()
    _check(p.tensor == 1 or kv % p.tensor == 0,
           lambda: f"parallel.tensor={p.tensor} must divide model.n_kv_head={kv} (each device takes whole "
                   f"key/value head groups); valid values: {_divisors(kv)}")
    _check(p.tensor == 1 or cfg.model.hidden() % p.tensor == 0,
           f"parallel.tensor={p.tensor} must divide the MLP's hidden size {cfg.model.hidden()}; set "
           f"model.mlp_hidden to a multiple of {p.tensor}")
    _check(p.shard_optimizer in SHARD_OPTIMIZER,
           f"parallel.shard_optimizer={p.shard_optimizer!r}; valid choices: {', '.join(SHARD_OPTIMIZER)}")
    if p.shard_optimizer != "none":
        _check(shard_refusal(cfg, cfg.strategy) is None, shard_refusal(cfg, cfg.strategy) or "")
    if cfg.train.eval_tasks:
        _check(eval_tasks_refusal(cfg.strategy) is None, eval_tasks_refusal(cfg.strategy) or "")
    _check(cfg.cluster.timeout_seconds >= 0,
           f"cluster.timeout_seconds={cfg.cluster.timeout_seconds} must be >= 0 (0 = no timeout)")


def _validate_model(m: ModelConfig) -> None:
    for name in ("n_layer", "n_head", "n_embd", "max_len"):
        _check(getattr(m, name) >= 1, f"model.{name}={getattr(m, name)} must be >= 1")
    _check(m.head_dim >= 0, f"model.head_dim={m.head_dim} must be >= 0 (0 = n_embd / n_head)")
    _check(m.head_dim or m.n_embd % m.n_head == 0,
           lambda: f"model.n_embd={m.n_embd} is not divisible by model.n_head={m.n_head}; "
                   f"valid n_head values: {_divisors(m.n_embd, at_most=64)} (or give model.head_dim)")
    _validate_family(m)
    _check(approx_params(m) <= MAX_PARAMS,
           lambda: f"the model has about {approx_params(m):.2e} parameters (model.n_layer={m.n_layer}, "
                   f"model.n_embd={m.n_embd}, model.vocab_size={m.vocab_size}), more than the cap of {MAX_PARAMS:.0e}")
    _check(0.0 <= m.dropout < 1.0, f"model.dropout={m.dropout} must be in [0, 1)")
    _check(m.vocab_size >= 0, f"model.vocab_size={m.vocab_size} must be >= 0 (0 = the tokenizer's)")
    _check(m.attention in ATTENTIONS, f"model.attention={m.attention!r}; valid choices: {', '.join(ATTENTIONS)}")
    _check(m.attention_block >= 1, f"model.attention_block={m.attention_block} must be >= 1")
    _check(m.attention == "dense" or m.dropout == 0, f"model.attention=blockwise has no attention dropout; set "
           f"model.dropout=0 (now {m.dropout}) or model.attention=dense")


def _validate_family(m: ModelConfig) -> None:
    _check(m.n_kv_head >= 0 and m.mlp_hidden >= 0,
           f"model.n_kv_head ({m.n_kv_head}) and model.mlp_hidden ({m.mlp_hidden}) must be >= 0 (0 = the default)")
    _check(m.rope_theta > 0 and m.norm_eps > 0,
           f"model.rope_theta ({m.rope_theta}) and model.norm_eps ({m.norm_eps}) must be > 0")
    families.get(m.family).validate(m, _check)  # the family's own checks (model/families/)


def profile_range(text: str, steps: int) -> tuple[int, int] | None:
    """train.profile_steps as (START, END), steps counted from 1 as the logs count them; None when off."""
    if not text.strip():
        return None
    match = re.fullmatch(r"\s*(\d{1,10})\s*:\s*(\d{1,10})\s*", text, re.ASCII)  # (10 digits: above train.steps' cap)
    start, end = (int(match[1]), int(match[2])) if match else (0, 0)
    base60 = " (in a YAML file, quote it: profile_steps: \"10:20\"; unquoted, YAML reads 10:20 as 620)" \
        if text.strip().isdigit() else ""
    _check(bool(match) and 1 <= start <= end, f"train.profile_steps={REPR.repr(text)}; give START:END with 1 <= START "
                                              f"<= END, e.g. 10:20 (steps counted from 1; \"\" = off){base60}")
    _check(end <= steps, f"train.profile_steps={text.strip()} ends after train.steps={steps}; give an END <= {steps}")
    return start, end


def _validate_comm(cfg: Config) -> None:
    k = cfg.comm
    _check(k.compression in COMPRESSIONS,
           f"comm.compression={k.compression!r}; valid choices: {', '.join(COMPRESSIONS)}")
    _check(k.outer_optimizer in OUTER_OPTIMIZERS,
           f"comm.outer_optimizer={k.outer_optimizer!r}; valid choices: {', '.join(OUTER_OPTIMIZERS)}")
    _check(k.rank >= 1, f"comm.rank={k.rank} must be >= 1")
    _check(0 < k.topk_ratio <= 1, f"comm.topk_ratio={k.topk_ratio} must be in (0, 1], e.g. 0.01 for 1%")
    _check(k.sync_every >= 1, f"comm.sync_every={k.sync_every} must be >= 1 (1 = synchronous every step)")
    _check(k.outer_lr > 0 and 0 <= k.outer_momentum < 1,
           f"comm.outer_lr ({k.outer_lr}) must be > 0 and comm.outer_momentum ({k.outer_momentum}) in [0, 1)")
    _check(k.sync_every > 1 or (k.outer_optimizer == "sgd" and k.outer_lr == 1.0),
           "comm.outer_optimizer and comm.outer_lr act on local SGD's outer step: set comm.sync_every > 1")
    _check(k.compression == "none" or k.sync_every == 1,
           f"comm.compression={k.compression} compresses per-step gradients, and comm.sync_every={k.sync_every} "
           "sends none between syncs: choose one (set comm.compression=none or comm.sync_every=1)")
    if not k.active():
        return
    what = _comm_settings(k)
    refusal = comm_refusal(k, cfg.strategy)
    _check(refusal is None, refusal or "")
    _check(cfg.precision != "mixed_float16",
           f"{what} does not support precision=mixed_float16 (loss-scaled gradients); use float32 or mixed_bfloat16")
    _check(k.sync_every == 1 or cfg.parallel.pipeline_stages == 1,
           f"{what} (local SGD) runs without pipeline stages; set parallel.pipeline_stages=1")
    _check(cfg.parallel.tensor == 1, f"{what} is not supported with parallel.tensor={cfg.parallel.tensor} "
                                     "(untested); set parallel.tensor=1 or drop the comm settings")


def shard_refusal(cfg: Config, strategy: str) -> str | None:
    """Why parallel.shard_optimizer cannot run with `cfg` under `strategy`, or None. The moments are divided
    over synchronous replicas that all hold the whole model: not over parameter-server workers (no replicas
    in sync), not across multi-worker processes (each process would save only its own replicas' rows: not
    built yet), not beside pipeline stages or tensor groups (not built yet), not under local SGD (replicas
    with weights of their own) or mixed_float16 (Keras' loss-scale optimizer owns that update); `grads`
    not beside gradient compression either (it exchanges whole gradients). Checked
    here on the config's strategy, and by training/assemble.py on the one strategy=auto chose."""
    what = f"parallel.shard_optimizer={cfg.parallel.shard_optimizer}"
    if strategy in ("parameter_server", "multi_worker"):
        return (f"{what} divides AdamW's moments over the replicas of one process (mirrored, tpu); "
                f"strategy={strategy} is not supported yet: set parallel.shard_optimizer=none")
    if cfg.parallel.pipeline_stages > 1 or cfg.parallel.tensor > 1:
        return (f"{what} with pipeline stages or tensor groups is not supported yet: set "
                "parallel.shard_optimizer=none, or parallel.pipeline_stages=1 and parallel.tensor=1")
    if cfg.comm.sync_every > 1:
        return (f"{what} and local SGD (comm.sync_every={cfg.comm.sync_every}): each replica keeps its own "
                "weights and moments between syncs; set one of them back (parallel.shard_optimizer=none)")
    if cfg.parallel.shard_optimizer == "grads" and cfg.comm.compression != "none":
        return (f"{what} reduces each micro-batch's gradients to each replica's rows itself; comm.compression="
                f"{cfg.comm.compression} compresses whole gradients: set comm.compression=none or "
                "parallel.shard_optimizer=state")
    if cfg.precision == "mixed_float16":
        return (f"{what} does not support precision=mixed_float16 (Keras' loss-scale optimizer); use "
                "mixed_bfloat16 or float32")
    return None


def eval_tasks_refusal(strategy: str) -> str | None:
    """Why train.eval_tasks cannot run under `strategy`, or None. The chief evaluates alone on its copy of the
    weights: multi-worker processes would wait for it in their next step's collectives (and stop at
    cluster.timeout_seconds), and parameter-server training has not been tried with it. Checked here on the
    config's strategy, and by training/assemble.py on the one strategy=auto chose."""
    if strategy in ("parameter_server", "multi_worker"):
        return (f"train.eval_tasks runs lm-eval on one process, which strategy={strategy} does not support yet: "
                "set train.eval_tasks='' and evaluate the run's checkpoints with `tpu-llm eval`")
    return None


def comm_refusal(k: CommConfig, strategy: str) -> str | None:
    """Why the comm settings `k` cannot run under `strategy`, or None. Compression and local SGD act on
    what synchronous replicas on CPUs/GPUs exchange: parameter-server workers apply their gradients
    asynchronously, and on TPU they are untested (its interconnect makes the plain all-reduce cheap).
    Checked here on the config's strategy, and by parallel/comm.py on the one strategy=auto chose."""
    if not k.active() or strategy not in ("parameter_server", "tpu"):
        return None
    return (f"{_comm_settings(k)} needs synchronous replicas on CPUs/GPUs; strategy={strategy} is not supported; "
            "use strategy=mirrored or multi_worker, or drop the comm settings")


def _comm_settings(k: CommConfig) -> str:
    """The comm setting in force, for a message."""
    return f"comm.compression={k.compression}" if k.compression != "none" else f"comm.sync_every={k.sync_every}"


LORA_BASE_DTYPES = ("float32", "bfloat16", "int8")  # train.lora_base_dtype: how a LoRA run stores its frozen base


def validate_lora(cfg) -> None:
    """The train.lora_* settings of `cfg` (a config.Config), each bad one a UserError of one line."""
    t = cfg.train
    _check(t.lora_rank >= 0, f"train.lora_rank={t.lora_rank} must be >= 0 (0 = off)")
    _check(t.lora_base_dtype in LORA_BASE_DTYPES,
           f"train.lora_base_dtype={t.lora_base_dtype!r}; valid choices: {', '.join(LORA_BASE_DTYPES)}")
    if not t.lora_rank:
        _check(t.lora_base_dtype == "float32", f"train.lora_base_dtype={t.lora_base_dtype} needs train.lora_rank > 0 "
                                               "(only a LoRA run's base is frozen); set train.lora_rank or drop it")
        return
    lora_targets(t.lora_targets, cfg.model.family)
    _check(t.lora_alpha > 0, f"train.lora_alpha={t.lora_alpha} must be > 0 (the adapters' scale is alpha / rank)")
    _check(0 <= t.lora_dropout < 1, f"train.lora_dropout={t.lora_dropout} must be in [0, 1)")
    _check(not t.freeze, f"train.freeze={REPR.repr(t.freeze)} with train.lora_rank={t.lora_rank}: LoRA freezes every "
                         "weight but the adapters already; drop train.freeze (or choose train.lora_targets)")
    _check(t.lora_dropout == 0 or cfg.parallel.tensor == 1,
           f"train.lora_dropout={t.lora_dropout} is not supported with parallel.tensor={cfg.parallel.tensor} (each "
           "group would draw its own mask of the adapter's input); set train.lora_dropout=0 or parallel.tensor=1")


def lora_targets(text: str, family: str) -> list[str]:
    """train.lora_targets as PEFT module names ("" = PEFT's default for the family); a UserError names an
    unknown one and the valid ones."""
    known = families.get(family)
    names, valid = known.peft_modules(text), known.peft_targets
    unknown = [n for n in names if n not in valid]
    _check(not unknown and bool(names),
           lambda: f"train.lora_targets={REPR.repr(text)}: {REPR.repr(unknown[0]) if unknown else 'no module'} is not a "
                   f"module of model.family={family}; valid targets: {', '.join(valid)}")
    return names


def adapted_layers(cfg) -> set:
    """The layers (paths below a block, e.g. attn/q) the run's adapters sit on in every block (a validated
    `cfg`); empty without adapters."""
    t = cfg.train
    if not t.lora_rank:
        return set()
    family = families.get(cfg.model.family)
    return {path for name in family.peft_modules(t.lora_targets) for path in family.peft_targets[name]}


def adapters_per_block(cfg) -> int:
    """The adapters' A and B parameters in one block (every block alike; model/adapters.py); 0 without."""
    return spec.adapter_params(cfg.model, cfg.train.lora_rank, adapted_layers(cfg))


def adapter_differences(saved: dict, current) -> list[str]:
    """The train.lora_* settings that made a run's adapters (rank, alpha, targets) and its stored base
    (lora_base_dtype), where `current` differs from the run's saved config (`saved`, config.yaml's dict):
    a checkpoint's adapters of another rank would not fit, with no adapters now they would be dropped
    without a word, and a base of another dtype has other variables (int8: kernel_scale). A run saved
    before lora_base_dtype existed had a float32 base."""
    theirs, ours = {"lora_base_dtype": "float32", **saved.get("train", {})}, current.train
    if not theirs.get("lora_rank") and not ours.lora_rank:
        return []
    return [f"train.{key}={REPR.repr(theirs.get(key))} (this config has {REPR.repr(getattr(ours, key))})"
            for key in ADAPTER_KEYS if theirs.get(key) != getattr(ours, key)]


ADAPTER_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "lora_base_dtype")  # train.*: what made the adapters


def trained_state(cfg, optimizer: bool = True) -> dict:
    """The train.* keys that decide the set, shape or meaning of a run's trained state (a validated
    `cfg`), as each checkpoint records them: a resume or a `generate` with another value dropped the
    adapters or read them at another scale, without a word. The targets are PEFT's module names (""
    spelt out as the family's default). With `optimizer` (training, not generation), also train.freeze in
    one spelling ("blocks:1,embeddings"): AdamW's moments are saved by position in the list of trainable
    variables, so another freeze would restore them into other layers (or fail on a shape). Layout keys
    (cpu_devices, parallel.*) are not among them: a run may resume in another layout."""
    t = cfg.train
    state = {"lora_rank": 0}
    if t.lora_rank:
        state = {"lora_rank": t.lora_rank, "lora_alpha": t.lora_alpha, "lora_base_dtype": t.lora_base_dtype,
                 "lora_targets": ",".join(lora_targets(t.lora_targets, cfg.model.family))}
    if optimizer:
        named, blocks = spec.frozen_layers(t.freeze, cfg.model.n_layer)
        state["freeze"] = ",".join(sorted(named) + [f"blocks:{b}" for b in sorted(blocks)])
    return state


def check_base_run(saved: dict, source: str) -> None:
    """train.init_from=`source` (its saved config `saved`) holds a base model: a UserError if it is a run
    with adapters, whose weights are no base model's (the adapters would be dropped)."""
    rank = saved.get("train", {}).get("lora_rank")
    if rank:
        # BASE: a new run directory (tests/test_hints.py runs this command as printed, then the init_from)
        raise UserError(f"train.init_from={source!r} is a LoRA run (train.lora_rank={rank}); start from a copy of it "
                        f"with its adapters merged in: `tpu-llm export --run_dir {shlex.quote(source)} --format run "
                        "--output BASE`, then train.init_from=BASE")
