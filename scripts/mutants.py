#!/usr/bin/env python3
"""`make mutants`: does the test suite notice real bugs? Apply each curated mutation of the core to a
scratch copy of the repository, run only the tests that should catch it, and print a table.

Each entry of MUTATIONS is one small source edit that a real bug could make: a name, the file, the
exact old text (it must occur exactly once in that file: a stale mutation is an error, found before
anything runs), the new text, and the pytest arguments that should fail with it (node ids, or a file
with `-k`). A mutation is "killed" when those tests fail, "survived" when they pass (a blind spot: add
or strengthen a test), "error" when pytest collected nothing or could not run.

    python scripts/mutants.py                  # every mutation, one at a time (~25 min on 2 cores)
    python scripts/mutants.py -k attend -k scale   # mutations whose name contains one of the words
    python scripts/mutants.py --list           # the list, with each mutation's tests
    python scripts/mutants.py --check          # only check that every old text is there once, every test exists
    python scripts/mutants.py --baseline       # also run each mutation's tests unmutated first

The scratch copy holds the files git tracks, as they are in the work tree (uncommitted edits
included; a new test file must be `git add`ed first).

Exit status: 0 if every mutation run was killed, 1 if any survived, 2 on a stale mutation or an
error. Not part of `make test` (CI's budget is the suite): run it when a feature lands, and add
mutations of the feature's core lines here with the tests that pin them (docs/development.md).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 900  # seconds per mutation; a hang counts as killed (a test that never ends fails in CI too)


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the repository
    old: str
    new: str
    tests: str  # pytest arguments, as on a command line


M = Mutation
MUTATIONS = [
    # ---- model ------------------------------------------------------------------------------------
    M("attend-sees-only-itself", "tpu_llm/model/attention.py",
      "<= (pos + tf.range(T))[:, None]", "== (pos + tf.range(T))[:, None]",
      "tests/test_model.py::test_the_last_position_sees_the_first_token_and_attend_matches_a_numpy_masked_softmax "
      "tests/test_model.py::test_a_copy_task_is_learned_only_by_attending_to_the_past"),
    M("attend-sees-the-future", "tpu_llm/model/attention.py",
      "<= (pos + tf.range(T))[:, None]", "<= (pos + T + tf.range(T))[:, None]",
      "tests/test_model.py::test_changing_a_later_token_never_changes_earlier_logits"),
    M("attend-ignores-the-position-offset", "tpu_llm/model/attention.py",
      "<= (pos + tf.range(T))[:, None]", "<= (tf.range(T))[:, None]",
      "tests/test_model.py::test_kv_cache_decoding_matches_the_full_forward_pass"),
    M("attend-no-1/sqrt(hd)", "tpu_llm/model/attention.py",
      "transpose_b=True) * (1.0 / math.sqrt(hd))", "transpose_b=True)",
      "tests/test_model.py::test_the_last_position_sees_the_first_token_and_attend_matches_a_numpy_masked_softmax"),
    M("softmax-over-heads-axis", "tpu_llm/model/attention.py",
      "tf.nn.softmax(scores, axis=-1)", "tf.nn.softmax(scores, axis=-2)",
      "tests/test_model.py::test_changing_a_later_token_never_changes_earlier_logits"),
    M("kv-cache-write-ignores-pos", "tpu_llm/model/layers.py",
      "onehot = tf.one_hot(pos + tf.range(T), L", "onehot = tf.one_hot(tf.range(T), L",
      "tests/test_model.py::test_kv_cache_decoding_matches_the_full_forward_pass"),
    M("no-position-embedding-offset", "tpu_llm/model/transformer.py",
      "self.wpe(pos + tf.range(T))[None]", "self.wpe(tf.range(T))[None]",
      "tests/test_model.py::test_kv_cache_decoding_matches_the_full_forward_pass"),
    M("no-attention-residual", "tpu_llm/model/transformer.py",
      "        x = x + a\n", "        x = a\n",  # (survives test_overfits_one_batch: the MLP still fits)
      "tests/test_tensor.py -k test_split_blocks_give_the_plain_models_loss_and_gradients"),
    M("logits-in-compute-dtype", "tpu_llm/model/transformer.py",
      "matmul(tf.cast(x, tf.float32), tf.cast(self.head_weights(), tf.float32), transpose=True)",
      "matmul(x, tf.cast(self.head_weights(), x.dtype), transpose=True)",
      "tests/test_pipeline.py::test_bfloat16_trains_close_to_float32_with_float32_variables"),
    M("attention-flops-term-dropped", "tpu_llm/model/spec.py",
      " + m.n_layer * attention_flops_per_token(m, seq_len)", "",
      "tests/test_model.py::test_parameter_count_and_flops_per_token"),
    M("spec-block-counts-no-biases", "tpu_llm/model/spec.py",
      '**({f"{name}/bias": (units,)} if bias else {})}', "}",
      "tests/test_model_spec.py -k test_the_spec_has_every_variable_of_the_built_model_and_each_groups_slices"),
    M("spec-kv-heads-as-wide-as-queries", "tpu_llm/model/spec.py",
      "q, kv = m.n_head * hd, m.kv_heads() * hd", "q, kv = m.n_head * hd, m.n_head * hd",
      "tests/test_model_spec.py -k test_the_spec_has_every_variable_of_the_built_model_and_each_groups_slices "
      "tests/test_families.py::test_llama_size_and_cost_agree_with_the_planner_and_the_partition"),
    M("decay-on-every-variable", "tpu_llm/model/transformer.py",
      'if len(v.shape) == 2 and not v.path.endswith("/embeddings")]', "]",
      "tests/test_model.py::test_weight_decay_applies_to_dense_kernels_only"),
    # ---- train ------------------------------------------------------------------------------------
    M("gradients-summed-over-replicas", "tpu_llm/training/trainer.py",
      "scale = 1.0 / (k * self.num_replicas)", "scale = 1.0 / k",
      "tests/test_distribute.py::test_mirrored_over_logical_cpus_trains_like_one_device"),
    M("gradient-accumulation-not-averaged", "tpu_llm/training/trainer.py",
      "scale = 1.0 / (k * self.num_replicas)", "scale = 1.0 / self.num_replicas",
      "tests/test_model.py::test_gradient_accumulation_equals_one_big_batch"),
    M("accumulation-drops-the-first-micro-batch", "tpu_llm/training/trainer.py",
      "loss_sum, grads = micro(xs[0], ys[0])", "loss_sum, grads = micro(xs[1], ys[1])",
      "tests/test_model.py::test_gradient_accumulation_equals_one_big_batch"),
    M("no-clipping", "tpu_llm/training/trainer.py",
      "        if self.clip_norm > 0:  # an overflow", "        if self.clip_norm < 0:  # an overflow",
      "tests/test_model.py -k logged_gradient_norm"),
    M("grad-norm-logged-after-clipping", "tpu_llm/training/trainer.py",
      "use_norm=grad_norm)[0], grads)\n", "use_norm=grad_norm)[0], grads)\n"
      "            grad_norm = tf.linalg.global_norm(grads)\n",
      "tests/test_model.py -k logged_gradient_norm"),
    M("non-finite-steps-applied", "tpu_llm/training/optimizer.py",
      "return tf.logical_and(tf.math.is_finite(loss), tf.math.is_finite(grad_norm))", "return tf.constant(True)",
      "tests/test_fault.py::test_non_finite_steps_are_skipped_then_stop_the_run_naming_the_last_good_checkpoint"),
    M("staleness-forced-to-0", "tpu_llm/training/trainer.py",
      "tf.cast(after - version - 1, tf.float32)", "tf.constant(0.0)",
      "tests/test_distribute.py::test_parameter_server_cluster_trains_asynchronously_and_the_loss_falls"),
    M("bf16-gradients-zeroed", "tpu_llm/parallel/pipeline.py",
      "k, g = index[id(v)], tf.convert_to_tensor(g)",
      "k, g = index[id(v)], tf.convert_to_tensor(g) * (0.0 if self.model.compute_dtype == 'bfloat16' else 1.0)",
      "tests/test_pipeline.py::test_bfloat16_trains_close_to_float32_with_float32_variables"),
    M("data-position-not-recorded", "tpu_llm/training/trainer.py",
      "            self.data_position.assign(position)", "            pass",
      "tests/test_train.py::test_resume_continues_exactly_like_an_uninterrupted_run"),
    M("adamw-sums-the-reduced-gradients-again", "tpu_llm/training/optimizer.py",
      "        return list(grads_and_vars)\n", "        return super()._all_reduce_sum_gradients(grads_and_vars)\n",
      "tests/test_tf_compat.py::test_keras_adamw_with_reduced_gradients_is_adamw_on_the_already_reduced_gradient"),
    M("adamw-decays-twice", "tpu_llm/training/optimizer.py",
      "        pass  # in update_step", "        super()._apply_weight_decay(variables)  # in update_step",
      "tests/test_tf_compat.py::test_keras_adamw_with_reduced_gradients_is_adamw_on_the_already_reduced_gradient"),
    M("adamw-update-loop-drifts-from-keras", "tpu_llm/training/optimizer.py",
      "args=(grad, learning_rate), group=False)", "args=(grad, learning_rate), group=True)",
      "tests/test_tf_compat.py::test_the_copied_keras_update_loop_is_still_keras_own"),
    # three bugs the whole suite used to let through (issue 26): each fails a test of tests/test_trainer.py
    M("warmup-removed", "tpu_llm/training/optimizer.py",
      "    if cfg.warmup_steps == 0:\n", "    if True:  # the schedule starts at the peak\n",
      "tests/test_trainer.py -k warms_up"),
    M("warmup-starts-at-zero", "tpu_llm/training/optimizer.py",
      "CosineDecay(cfg.lr / cfg.warmup_steps,", "CosineDecay(0.0,",
      "tests/test_trainer.py -k warms_up"),
    M("clip-norm-ignored", "tpu_llm/training/trainer.py",
      "self.grad_accum, self.clip_norm = cfg.grad_accum, cfg.clip_norm",
      "self.grad_accum, self.clip_norm = cfg.grad_accum, 0.0",
      "tests/test_trainer.py -k clip_norm_bounds"),
    M("validation-in-training-mode", "tpu_llm/training/trainer.py",
      "return self.pipeline.loss(inputs, targets, training=False)",
      "return self.pipeline.loss(inputs, targets, training=True)",
      "tests/test_trainer.py -k validation_runs_without_dropout"),
    # ---- pipeline and tensor ------------------------------------------------------------------------
    M("tpu-update-not-per-stage", "tpu_llm/training/trainer.py",
      "inner.placement_of = lambda var:", "inner.placement_of = None  # lambda var:",
      "tests/test_placement.py -k 'traced_train_step and 2-1'"),
    M("tpu-reduction-not-per-stage", "tpu_llm/training/trainer.py",
      "            with self.pipeline.placement.at(layers=i):\n                for k, g in zip(",
      "            with tf.name_scope('unplaced'):\n                for k, g in zip(",
      "tests/test_placement.py -k 'traced_train_step and 2-1'"),
    M("tensor-backward-on-group-0", "tpu_llm/parallel/tensor.py",
      "self._on_group(layer, x_g, weights, g)", "layer.group_part(x_g, weights, training=self.training)",
      "tests/test_placement.py -k 'traced_train_step and 1-2'"),
    M("pipeline-seed-not-divided-by-microbatches", "tpu_llm/parallel/pipeline.py",
      "target = seed(out / m) if i == last else out", "target = seed(out) if i == last else out",
      "tests/test_pipeline.py -k test_pipelined_loss_and_gradients_equal_the_plain_model"),
    M("pipeline-no-upstream-gradient", "tpu_llm/parallel/pipeline.py",
      "upstream = out[-1] if i else None", "upstream = None",
      "tests/test_pipeline.py -k test_pipelined_loss_and_gradients_equal_the_plain_model"),
    M("pipeline-bubble-formula", "tpu_llm/parallel/pipeline.py",
      "return (stages - 1) / (microbatches + stages - 1)", "return (stages - 1) / microbatches",
      "tests/test_pipeline.py::test_gpipe_bubble_formula"),
    M("tensor-group-takes-the-first-heads", "tpu_llm/model/transformer.py",
      "_heads_of(slice(g * h, (g + 1) * h)", "_heads_of(slice(0, h)",
      "tests/test_tensor.py -k test_split_blocks_give_the_plain_models_loss_and_gradients"),
    M("tensor-bias-added-per-group", "tpu_llm/model/transformer.py",
      "return self.part(x, sliced(w), training)[0]",
      "return self.part(x, sliced(w), training)[0] + tf.cast(self.proj.bias, x.dtype)",
      "tests/test_tensor.py -k test_split_blocks_give_the_plain_models_loss_and_gradients"),
    M("tensor-slice-gradients-dropped", "tpu_llm/parallel/tensor.py",
      "return (dx, *rest[:len(slices)]), rest[len(slices):]", "return (dx, *[None] * len(slices)), rest[len(slices):]",
      "tests/test_tensor.py -k test_split_blocks_give_the_plain_models_loss_and_gradients"),
    # ---- issue 38: placement that survives compilation, remat masks, freeze ------------------------------
    M("nested-function-on-tpu", "tpu_llm/training/trainer.py",
      "nested = (lambda fn: fn) if dist.placement.tpu_strategy is not None else",
      "nested = (lambda fn: tf.function(fn, jit_compile=False)) if dist.placement.tpu_strategy is not None else",
      "tests/test_placement.py::test_the_evaluation_step_runs_each_stage_on_its_own_core"),
    M("accumulation-outside-the-stage-scope", "tpu_llm/training/trainer.py",
      "grads = self.by_stage(lambda pairs: [g + gi for g, gi in pairs], list(zip(grads, grads_i)))",
      "grads = [g + gi for g, gi in zip(grads, grads_i)]",
      "tests/test_placement.py::test_every_stage_and_group_runs_its_forward_and_backward_matmuls_on_its_own_core"),
    M("remat-draws-new-masks", "tpu_llm/parallel/pipeline.py",
      "return remat_with_dropout(run, block) if remat and training else run",
      "return tf.recompute_grad(run) if remat and training else run",
      "tests/test_pipeline.py::test_remat_with_dropout_recomputes_the_forwards_masks"),
    M("remat-state-not-advanced", "tpu_llm/parallel/pipeline.py",
      "generator.state.assign(state + tf.constant([0, n], state.dtype))", "generator.state.assign(state)",
      "tests/test_pipeline.py::test_remat_with_dropout_recomputes_the_forwards_masks"),
    M("tensor-group-slices-on-the-group-core", "tpu_llm/parallel/tensor.py",
      "                weights = layer.group_weights(g, self.ways, x.dtype)\n"
      "                with self.placement.at(layers=self.stage, heads=g), seed_of_group(g):\n",
      "                with self.placement.at(layers=self.stage, heads=g), seed_of_group(g):\n"
      "                    weights = layer.group_weights(g, self.ways, x.dtype)\n",
      "tests/test_placement.py::test_tensor_groups_move_slices_not_whole_kernels"),
    M("freeze-empty-stage-in-the-norm", "tpu_llm/training/trainer.py",
      "            if not indices:  # a stage train.freeze left nothing to train\n                continue\n", "",
      "tests/test_pipeline.py::test_freezing_every_variable_of_a_stage_trains_the_others"),
    M("unknown-variable-on-stage-0", "tpu_llm/parallel/pipeline.py",
      "        return owner[id(variable)]\n", "        return owner.get(id(variable), 0)\n",
      "tests/test_pipeline.py::test_a_variable_no_stage_reads_is_an_error_naming_it_not_stage_0 "
      "tests/test_placement.py::test_the_update_of_a_variable_no_stage_owns_is_an_error_naming_it_not_core_0"),
    M("unknown-variable-update-on-core-0", "tpu_llm/training/trainer.py",
      "dist.placement.at(layers=owning_stage(where, var))", "dist.placement.at(layers=where.get(id(var), 0))",
      "tests/test_placement.py::test_the_update_of_a_variable_no_stage_owns_is_an_error_naming_it_not_core_0"),
    M("pjrt-for-tpu7x", "tpu_llm/platform/tpu_chips.py",
      "if kind in PJRT_KINDS or (kind is None and unknown_is_pjrt):", "if kind is not None or unknown_is_pjrt:",
      "tests/test_tpu.py::test_one_table_of_the_runtime_per_generation "
      "tests/test_tpu.py::test_pjrt_only_where_google_documents_tensorflows_pjrt_runtime"),
    M("worker-plan-ignores-the-generation", "tpu_llm/cloud/worker_plan.py",
      'runtime_variables(kind_of_type(str(self.o["accelerator_type"])), LIBTPU)',
      'runtime_variables(None, LIBTPU)',
      "tests/test_tpu_safety.py::test_the_setup_checks_the_venv_libtpu_is_the_pinned_one"),
    M("doctor-does-not-say-the-runtime", "tpu_llm/tools/doctor/__init__.py",
      "    elif found.tpu and runtime:\n", "    elif False:\n",
      "tests/test_doctor.py -k runtime_and_libtpu"),
    M("doctor-hlo-ignores-matmuls-without-a-core", "tpu_llm/tools/doctor/hlo.py",
      "counts[kind][0 if core is None else core] += 1", "counts[kind][core] += core is not None",
      "tests/test_doctor_hlo.py -k 'core_0_heavy'"),
    M("doctor-hlo-reads-the-optimized-module", "tpu_llm/tools/doctor/hlo.py",
      'stage = stage or "before"', 'stage = stage or "after"',
      "tests/test_doctor_hlo.py -k 'core_0_heavy'"),
    # ---- comm ---------------------------------------------------------------------------------------
    M("powersgd-residual-not-divided-by-replicas", "tpu_llm/parallel/comm.py",
      "updates.append((e, tf.reshape(mat - approx / replicas, shape)))",
      "updates.append((e, tf.reshape(mat - approx, shape)))",
      "tests/test_comm.py::test_powersgd_error_feedback_tracks_the_sum_of_true_gradients"),
    M("powersgd-no-orthonormalisation", "tpu_llm/parallel/comm.py",
      "ps = [tf.linalg.qr(p).q for p in ps]", "ps = list(ps)",
      "tests/test_comm.py::test_powersgd_at_full_rank_reproduces_the_average"),
    M("topk-residual-keeps-the-sent-entries", "tpu_llm/parallel/comm.py",
      "residual = tf.tensor_scatter_nd_update(flat, idx[:, None], tf.zeros([self.k[i]], flat.dtype))",
      "residual = flat",
      "tests/test_comm.py::test_topk_sends_exactly_k_entries_and_carries_the_rest"),
    M("local-sgd-sync-off-by-one", "tpu_llm/parallel/comm.py",
      "return tf.equal(step % self.sync_every, 0)", "return tf.equal(step % self.sync_every, 1)",
      "tests/test_comm.py::test_local_sgd_replicas_diverge_between_syncs_and_agree_after_each"),
    M("local-sgd-outer-step-sign", "tpu_llm/parallel/comm.py",
      "weights.append(a.read_value() - self.outer_lr * d)", "weights.append(a.read_value() + self.outer_lr * d)",
      "tests/test_comm.py::test_local_sgd_with_one_local_step_equals_synchronous_data_parallel"),
    # ---- fault --------------------------------------------------------------------------------------
    M("divided-moments-keep-a-bad-step", "tpu_llm/training/sharded_adamw.py",
      "m.assign(tf.where(applied, m_new, m))", "m.assign(m_new)",
      "tests/test_shard_optimizer.py::test_with_lora_on_a_bfloat16_step_and_a_skipped_bad_step_too"),
    M("divided-moments-every-replica-takes-rows-0", "tpu_llm/training/sharded_adamw.py",
      "index = replica * rows + tf.range(rows)", "index = tf.range(rows)",
      "tests/test_shard_optimizer.py::test_divided_moments_train_exactly_like_whole_ones"),
    M("divided-moments-saved-at-offset-0", "tpu_llm/training/sharded_adamw.py",
      "[r * moment.rows] + [0] * len(rest)", "[0] + [0] * len(rest)",
      "tests/test_shard_optimizer.py::test_a_checkpoint_moves_between_replica_counts_and_settings"),
    M("divided-moments-without-weight-decay", "tpu_llm/training/sharded_adamw.py",
      "if self.decays[i]:", "if False:",
      "tests/test_shard_optimizer.py::test_divided_moments_train_exactly_like_whole_ones"),
    M("rollback-restores-nothing", "tpu_llm/training/fault.py",
      "            self.run.checkpointer.restore(latest)\n",
      "            self.run.optimizer.iterations.assign(latest_step)\n",
      "tests/test_fault.py::test_rollback_restores_the_newest_checkpoint_and_skips_the_bad_batches"),
    M("bad-steps-limit-off-by-one", "tpu_llm/training/fault.py",
      "if self.total > self.max:", "if self.total >= self.max:",
      "tests/test_fault.py::test_non_finite_steps_are_skipped_then_stop_the_run_naming_the_last_good_checkpoint"),
    M("second-signal-ignored", "tpu_llm/training/fault.py",
      "if self.received == signum and self._handled:", "if False:",
      "tests/test_fault.py::test_a_second_signal_ends_the_process_at_once_and_sigint_exits_130"),
    M("sigint-exit-code", "tpu_llm/training/fault.py",
      "EXIT_SIGNAL.get(self.received, 143)", "143",
      "tests/test_fault.py::test_a_second_signal_ends_the_process_at_once_and_sigint_exits_130"),
    M("signal-flag-not-set", "tpu_llm/training/fault.py",
      "                    self.flag.assign(1)\n", "                    pass\n",
      "tests/test_fault.py::test_a_signal_sets_the_flag_while_the_main_thread_is_inside_a_tensorflow_call"),
    # ---- the host loop and its record ----------------------------------------------------------------
    M("interval-due-after-a-cut-short-call", "tpu_llm/training/record.py",
      "return self.step == self.end and (", "return (",
      "tests/test_record.py -k due"),
    M("summary-counts-the-compiling-call", "tpu_llm/training/record.py",
      "timed = records[1:] or records", "timed = records",
      "tests/test_record.py -k summary"),
    M("first-bad-step-0-based", "tpu_llm/training/trainer.py",
      "first_bad_step=min(bad) + 1 if bad else -1", "first_bad_step=min(bad) if bad else -1",
      "tests/test_record.py -k folds"),
    M("loop-ignores-the-rollback", "tpu_llm/training/controller.py",
      "                record = guard.after_call(record)", "                guard.after_call(record)",
      "tests/test_fault.py::test_rollback_restores_the_newest_checkpoint_and_skips_the_bad_batches"),
    # ---- checkpoint ---------------------------------------------------------------------------------
    M("links-in-checkpoints-followed", "tpu_llm/platform/run_layout.py",
      "    if entry.is_symlink():  # from the directory entry", "    if False:  # from the directory entry",
      "tests/test_run_directory.py -k 'planted and ckpt'"),
    M("links-below-the-top-unseen", "tpu_llm/platform/run_layout.py",
      "        if entry.is_dir(follow_symlinks=False):", "        if False:",
      "tests/test_run_layout.py -k anywhere tests/test_run_consistency.py -k link"),
    M("checkpoint-step-takes-any-digits", "tpu_llm/platform/run_layout.py",
      "digits.isascii() and digits.isdigit()", "digits.isdigit()",
      "tests/test_run_layout.py::test_any_other_name_has_no_step"),
    M("atomic-write-leaves-its-temporary-file", "tpu_llm/platform/files.py",
      "            os.remove(tmp)\n", "            pass\n",
      "tests/test_files.py::test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file"),
    M("special-file-opened", "tpu_llm/platform/files.py",
      "        if not stat.S_ISREG(info.st_mode):", "        if False:",
      "tests/test_trust_boundaries.py::test_open_regular_refuses_a_fifo_a_device_a_link_and_with_single_link_a_hard_link"),
    M("hard-link-written-through", "tpu_llm/platform/files.py",
      "        if single_link and info.st_nlink > 1:", "        if False:",
      "tests/test_trust_boundaries.py::test_a_log_hard_linked_out_of_the_run_directory_is_refused_never_appended_to"),
    M("read-unbounded", "tpu_llm/platform/files.py",
      "    if len(data) > max_bytes:", "    if False:",
      "tests/test_trust_boundaries.py::test_read_regular_is_bounded_for_a_file_whose_size_reads_as_0"),
    M("shard-ids-unbounded", "tpu_llm/data/dataset.py",
      "        w = bounded_ids(w, vocab_size) if vocab_size else w", "        pass",
      "tests/test_run_consistency.py -k shard_id"),
    M("prepare-into-a-run", "tpu_llm/data/prepare.py",
      "    if run_files:", "    if False:",
      "tests/test_trust_boundaries.py::test_data_prepare_never_writes_into_a_run_directory"),
    M("non-finite-imported", "tpu_llm/interop/hf.py",
      "            if not allow_non_finite:", "            if False:",
      "tests/test_trust_boundaries.py::test_import_refuses_non_finite_tensors_naming_them_unless_allowed"),
    M("model-section-not-checked", "tpu_llm/training/checkpoint.py",
      '            if self.model_config is not None and "model_config" in held:',
      '            if False:',
      "tests/test_run_directory.py::test_an_edited_model_section_with_the_same_shapes_is_refused_on_resume"),
    M("tokenizer-record-not-checked", "tpu_llm/training/checkpoint.py",
      '            if self.tokenizer and "tokenizer" in held:', "            if False:",
      "tests/test_run_consistency.py -k tokenizer"),
    M("lock-file-shared", "tpu_llm/training/run_lock.py",
      "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)", "fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)",
      "tests/test_run_directory.py::test_a_second_lock_on_a_run_directory_is_refused_naming_the_holder"),
    M("export-deletes-before-replacing", "tpu_llm/interop/export.py",
      "            tf.io.gfile.rename(target, old)\n",
      "            tf.io.gfile.rmtree(target)\n            old = None\n",
      "tests/test_export.py::test_overwrite_replaces_never_destroys"),
    M("restore-skips-the-optimizer", "tpu_llm/training/checkpoint.py",
      'if k not in self.NOT_RESTORED and (k in held or k == "model")}',
      'if k not in self.NOT_RESTORED and k != "optimizer" and (k in held or k == "model")}',
      "tests/test_train.py::test_checkpoint_restore_is_bit_identical"),
    M("corrupt-newest-checkpoint-not-skipped", "tpu_llm/training/checkpoint.py",
      "                skipped.append((path, str(e)))\n                continue\n",
      "                raise UserError(str(e)) from None\n",
      "tests/test_fault.py::test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_one"),
    M("failed-save-leaves-partial-files", "tpu_llm/training/checkpoint.py",
      "                        _remove(leftover)\n", "                        pass\n",
      "tests/test_fault.py -k test_time_based_checkpoints_and_a_failed_save"),
    # ---- data ---------------------------------------------------------------------------------------
    M("pack-drops-the-carry", "tpu_llm/data/dataset.py",
      "return stream[n * window:], full", "return tf.zeros([0], tf.int32), full",
      "tests/test_data.py -k test_pack_keeps_every_token_in_order"),
    M("targets-not-shifted", "tpu_llm/data/dataset.py",
      "        return w[:, :-1], w[:, 1:]", "        return w[:, :-1], w[:, :-1]",
      "tests/test_data.py::test_training_batches_static_shapes_and_shifted_targets"),
    M("resume-ignores-the-saved-position", "tpu_llm/data/lanes.py",
      "stream = stream.prefetch(1).unbatch().skip(taken)", "stream = stream.prefetch(1).unbatch()",
      "tests/test_data.py -k test_the_training_stream_resumes_exactly_from_a_saved_position"),
    # ---- distribute ---------------------------------------------------------------------------------
    M("auto-ignores-a-two-task-cluster", "tpu_llm/parallel/distribute.py",
      "if found.cluster_size > 1:  # before local GPUs", "if found.cluster_size > 2:  # before local GPUs",
      "tests/test_distribute.py -k test_auto_and_explicit_choices"),
    M("auto-does-not-mirror-two-cpu-devices", "tpu_llm/parallel/distribute.py",
      '    if replicas > 1:\n        return "mirrored", f"strategy=auto:',
      '    if replicas > 2:\n        return "mirrored", f"strategy=auto:',
      "tests/test_distribute.py -k test_auto_and_explicit_choices"),
    # ---- plan ---------------------------------------------------------------------------------------
    M("planner-without-attention-scores", "tpu_llm/model/spec.py",
      "    return linear + scores, c * act_bytes", "    return linear, c * act_bytes",
      "tests/test_plan.py::test_memory_estimate_within_20_percent_of_xla_on_cpu"),
    M("planner-adam-moments-once", "tpu_llm/tools/plan_memory.py",
      "return Memory(parameter_bytes(cfg, stage, adapters), 8 * trainable / shards, grads,",
      "return Memory(parameter_bytes(cfg, stage, adapters), 4 * trainable / shards, grads,",
      "tests/test_plan.py::test_parameters_and_optimizer_bytes_are_exact"),
    M("planner-divides-moments-without-the-setting", "tpu_llm/tools/plan_memory.py",  # issue 48
      'shards = replicas if cfg.parallel.shard_optimizer == "state" else 1', "shards = replicas",
      "tests/test_plan.py::test_the_moments_are_divided_over_the_replicas_only_with_the_setting"),
    M("planner-adam-state-for-frozen-layers", "tpu_llm/tools/plan_memory.py",  # issue 41
      "trainable = params + adapters - frozen_params(cfg, stage, vocab)", "trainable = params + adapters",
      "tests/test_plan.py -k test_frozen_layers_get_no_optimizer_state"),
    M("planner-frozen-weights-get-weight-gradient-flops", "tpu_llm/model/spec.py",  # issue 41
      "+ (2 * p if trains else 0) + 4 * adapters", "+ 2 * p + 4 * adapters",
      "tests/test_plan.py -k test_frozen_weights_have_no_weight_gradient_flops"),
    M("planner-backward-through-frozen-bottom-blocks", "tpu_llm/model/spec.py",  # issue 41
      'through = not adapted and "embeddings" not in names', "through = True",
      "tests/test_plan.py -k test_frozen_weights_have_no_weight_gradient_flops"),
    M("planner-lora-base-gets-adam-state", "tpu_llm/tools/plan_memory.py",  # issue 41: against the compiled step
      "    if cfg.train.lora_rank:\n        return stage.params", "    if cfg.train.lora_rank:\n        return 0",
      "tests/test_plan.py -k test_lora_trainable_and_adamw_bytes_in_the_compiled_step_match_the_plan"),
    M("planner-lora-adapter-outputs-not-kept-apart", "tpu_llm/model/spec.py",  # issue 41
      "    return 2 * len(hidden) * m.hidden() * act_bytes / ways", "    return 0.0",
      "tests/test_plan.py -k test_lora_and_a_frozen_table_temp_within_15_percent_of_xla"),
    M("planner-frozen-table-lends-its-gradient-room", "tpu_llm/tools/plan_memory.py",  # issue 41
      "forward <= 4 * vocab * c and table_trains:", "forward <= 4 * vocab * c:",
      "tests/test_plan.py -k test_lora_and_a_frozen_table_temp_within_15_percent_of_xla"),
    M("mfu-counts-lora-base-weight-gradients", "tpu_llm/training/controller.py",  # issue 41
      "phases.flops_per_token(cfg, run.model.vocab_size), peak)", "run.model.flops_per_token(d.seq_len), peak)",
      "tests/test_lora.py -k test_training_moves_only_the_adapters_and_resume_is_exact"),
    M("header-flops-count-lora-base-weight-gradients", "tpu_llm/training/header.py",  # issue 41
      "perf.format_count(phases.flops_per_token(cfg, run.model.vocab_size))",
      "perf.format_count(run.model.flops_per_token(d.seq_len))",
      "tests/test_lora.py -k test_training_moves_only_the_adapters_and_resume_is_exact"),
    M("planner-logits-workspace-dropped", "tpu_llm/tools/plan_memory.py",
      "    return 4 * vocab, 4 * vocab * tokens_micro, 0.0", "    return 4 * vocab, 0.0, 0.0",
      "tests/test_plan.py::test_memory_estimate_within_20_percent_of_xla_on_cpu "
      "tests/test_memory.py::test_planner_counts_the_chunked_loss_and_blockwise_attention_within_15_percent_of_xla"),
    # ---- issue 19: chunked loss, blockwise attention, the planner's memory terms ----------------------
    M("online-softmax-rescale-dropped", "tpu_llm/model/attention.py",
      "acc * rescale[..., None] + pv", "acc + pv",
      "tests/test_memory.py::test_blockwise_attention_equals_dense_with_fewer_kv_heads_and_while_decoding"),
    M("blockwise-skips-a-visible-key-block", "tpu_llm/model/attention.py",
      "(pos + (i + 1) * bq - 1) // bk + 1)", "(pos + (i + 1) * bq - 1) // bk)",
      "tests/test_memory.py::test_blockwise_attention_equals_dense_with_fewer_kv_heads_and_while_decoding"),
    M("loss-chunk-counts-a-padding-row", "tpu_llm/model/loss.py",
      "tf.range(k * chunk) < n", "tf.range(k * chunk) <= n",
      "tests/test_memory.py::test_the_loss_and_the_chunked_loss_equal_tfs_fused_op_with_their_gradients"),
    M("loss-slice-overlap-counted-twice", "tpu_llm/model/loss.py",
      "dx += tf.matmul(g * new, ws)", "dx += tf.matmul(g, ws)",
      "tests/test_memory.py::test_the_loss_and_the_chunked_loss_equal_tfs_fused_op_with_their_gradients"),
    M("loss-gradient-without-onehot", "tpu_llm/model/loss.py",
      "tf.exp(z - lse[:, None]) * scale - tf.one_hot(y, v, dtype=tf.float32) * scale", "tf.exp(z - lse[:, None]) * scale",
      "tests/test_memory.py::test_the_loss_and_the_chunked_loss_equal_tfs_fused_op_with_their_gradients"),
    M("planner-attention-backward-phase-dropped", "tpu_llm/tools/plan_memory.py",
      "work += max(phases + [block_phase])", "work += max(phases)",
      "tests/test_plan.py::test_memory_estimate_within_20_percent_of_xla_on_cpu"),
    # ---- model families (issue 18) ----------------------------------------------------------------
    # ---- issue 47: families as modules, named mesh axes ---------------------------------------------
    M("family-defaults-not-applied", "tpu_llm/config/__init__.py",
      "    if base is None:\n        _family_defaults(cfg, given)\n", "",
      "tests/test_families.py::test_a_family_brings_its_defaults_where_the_config_gives_none"),
    M("mesh-axes-numbered-tensor-major", "tpu_llm/parallel/mesh.py",
      "        for axis in AXES[1:]:\n            flat = flat * self.size(axis) + at[axis]",
      "        for axis in reversed(AXES[1:]):\n            flat = flat * self.size(axis) + at[axis]",
      "tests/test_tensor.py::test_tpu_placement_puts_each_group_on_its_logical_core"),
    M("qwen3-q-k-norms-skipped", "tpu_llm/model/transformer.py",
      "            q, k = self.q_norm(q), self.k_norm(k)", "            pass",
      "tests/test_hf.py -k 'new_families_import and qwen3'"),
    M("hf-head-dim-dropped", "tpu_llm/model/families/base.py",
      '        return {} if head_dim * H == C else {"head_dim": head_dim}', "        return {}",
      "tests/test_hf.py -k 'new_families_import and qwen3'"),
    M("rope-interleaved-pairs", "tpu_llm/model/layers.py",  # GPT-J's layout: HF Llama q/k weights would be permuted
      "x1, x2 = x[..., :hd // 2], x[..., hd // 2:]", "x1, x2 = x[..., 0::2], x[..., 1::2]",
      "tests/test_families.py -k test_llama_logits_match_a_numpy_reference_of_hf_llama"),
    M("rope-ignores-the-position-offset", "tpu_llm/model/layers.py",
      "angles = tf.cast(pos + tf.range(T), tf.float32)", "angles = tf.cast(tf.range(T), tf.float32)",
      "tests/test_model.py -k 'test_kv_cache_decoding_matches_the_full_forward_pass and llama'"),
    M("gqa-query-head-reads-kv-head-h-mod-hkv", "tpu_llm/model/attention.py",
      "q = tf.reshape(q, [B, Hkv, (H // Hkv) * T, hd])",
      "q = tf.reshape(tf.transpose(tf.reshape(q, [B, H // Hkv, Hkv, T, hd]), [0, 2, 1, 3, 4]), [B, Hkv, -1, hd])",
      "tests/test_families.py -k test_llama_logits_match_a_numpy_reference_of_hf_llama"),
    M("rmsnorm-epsilon-outside-the-root", "tpu_llm/model/layers.py",
      "keepdims=True) + self.eps)", "keepdims=True)) + self.eps",
      "tests/test_families.py::test_rmsnorm_keeps_its_epsilon_inside_the_root_for_small_inputs"),
    # ---- issue 18: Hugging Face tokenizers (data.tokenizer=hf) -------------------------------------
    M("hf-shards-without-bos", "tpu_llm/tokenizers/hf.py",
      "return self._trim(self._tok.encode(text).ids)", "return self._trim(self._tok.encode(text, add_special_tokens=False).ids)",
      "tests/test_hf_tokenizer.py::test_data_prepare_writes_the_ids_of_transformers"),
    M("hf-decode-keeps-special-tokens", "tpu_llm/tokenizers/hf.py",
      "skip_special_tokens=True)", "skip_special_tokens=False)",
      "tests/test_hf_tokenizer.py::test_llama_ids_equal_transformers_and_sentencepiece"),
    M("sample-refill-keeps-the-wrong-window", "tpu_llm/model/sampling.py",
      "    half = max(L // 2, 1)", "    half = max(L // 2 + 1, 1)",
      "tests/test_generate.py::test_cached_generation_matches_recompute_and_runs_past_the_context"),
    M("sample-decoded-without-its-prompt", "tpu_llm/model/sampling.py",
      "return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)",
      "return tokenizer.decode(ids)",
      "tests/test_hf_tokenizer.py::test_continuation_keeps_the_space_llama_decoding_drops"),
    # ---- evaluation (issue 49) ----------------------------------------------------------------------------
    M("eval-merged-adapters-at-the-wrong-scale", "tpu_llm/model/adapters.py",
      "return float_kernel(layer) + tf.matmul(layer.lora_a, layer.lora_b) * layer.scale",
      "return float_kernel(layer) + tf.matmul(layer.lora_a, layer.lora_b)",
      "tests/test_eval.py::test_a_lora_run_evaluates_as_its_merged_copy"),
    M("eval-vocabulary-not-checked", "tpu_llm/eval/backend.py",
      "        self._check_covered(string)\n", "",
      "tests/test_eval.py::test_text_the_vocabulary_cannot_hold_is_said_once_for_tasks_and_refused_for_a_text_file"),
    M("eval-in-the-loop-on-stale-weights", "tpu_llm/eval/in_loop.py",
      "            self.copy.set_weights(model.get_weights())", "            pass",
      "tests/test_eval_loop.py::test_tasks_are_logged_and_equal_an_evaluation_of_the_checkpoint"),
    M("eval-git-describe-on-the-terminal", "tpu_llm/eval/run.py",
      "    evaluator.get_git_commit_hash = commit\n", "",
      "tests/test_eval.py::test_outside_a_checkout_git_stays_off_the_terminal_and_the_loop_skips_the_environment"),
    # ---- beam search (issue 41) --------------------------------------------------------------------------
    M("beam-cache-not-reordered", "tpu_llm/model/beam_search.py",
      "cache = [(tf.gather(k, rows), tf.gather(v, rows)) for k, v in cache]", "cache = list(cache)",
      "tests/test_beam_search.py -k 'default_length_penalty or log_probabilities'"),
    M("beam-length-penalty-ignored", "tpu_llm/model/beam_search.py",
      "score = top / tf.cast(t + 1, tf.float32) ** length_penalty", "score = top / tf.cast(t + 1, tf.float32)",
      "tests/test_beam_search.py -k 'length_penalty_scores or log_probabilities'"),
    M("beam-early-stopping-never-at-the-current-length", "tpu_llm/model/beam_search.py",
      "(length_penalty > 0), max_new_tokens, t + 1)", "(length_penalty > 0), t + 1, t + 1)",
      "tests/test_beam_search.py -k never"),
    M("beam-early-stopping-true-goes-on", "tpu_llm/model/beam_search.py",
      "stop_when_full = early_stopping == STOP_TRUE", "stop_when_full = early_stopping == -1",
      "tests/test_beam_search.py -k early_stopping_true"),
    # ---- Hugging Face import / export and fine-tuning (issue 18) -----------------------------------------
    M("hf-gpt2-conv1d-transposed", "tpu_llm/model/families/gpt2.py",
      'out += [(f"{h}{hf_name}.weight", f"{b}{ours}/{w}", False),',
      'out += [(f"{h}{hf_name}.weight", f"{b}{ours}/{w}", not ours.startswith("ln")),',
      "tests/test_hf.py -k 'test_imported_logits_match_transformers and gpt2'"),
    M("hf-export-writes-float32-under-a-bf16-header", "tpu_llm/interop/safetensors_io.py",
      'array = np.asarray(produce(name), dtype=np.dtype(dtype).newbyteorder("<"), order="C")',
      'array = np.asarray(produce(name), order="C")',
      "tests/test_hf.py -k 'test_import_then_export_is_bit_identical and bfloat16'"),
    M("safetensors-0-d-tensor-written-as-1-d", "tpu_llm/interop/safetensors_io.py",
      'array = np.asarray(produce(name), dtype=np.dtype(dtype).newbyteorder("<"), order="C")',
      'array = np.ascontiguousarray(produce(name), dtype=np.dtype(dtype).newbyteorder("<"))',
      "tests/test_safetensors_io.py::test_what_we_write_the_library_reads_identically"),
    M("hf-import-forgets-the-bf16-dtype", "tpu_llm/interop/hf.py",
      'return dtypes[0] if len(dtypes) == 1 else "float32"', 'return "float32"',
      "tests/test_hf.py -k 'test_import_then_export_is_bit_identical and bfloat16'"),
    M("freeze-ignored", "tpu_llm/training/optimizer.py",
      "        layer.trainable = False\n", "        layer.trainable = True\n",
      "tests/test_hf_finetune.py -k test_fine_tuning_an_imported_checkpoint"),
    # ---- families: Llama 3.x, Qwen2, Mistral (issue 41) ------------------------------------------------
    M("llama3-rope-scaling-ignored", "tpu_llm/model/layers.py",
      "inv_freq = llama3_frequencies(inv_freq, *scaling)", "inv_freq = inv_freq",
      "tests/test_hf.py -k 'test_new_families_import and llama3'"),
    M("llama3-rope-without-smoothing", "tpu_llm/model/layers.py",
      "return tf.where(medium, smoothed, scaled)", "return scaled",
      "tests/test_hf.py -k 'test_new_families_import and llama3'"),
    M("tensor-group-takes-the-first-bias-slice", "tpu_llm/model/layers.py",
      'w[f"{name}/bias"] = cut(tf.cast(dense.bias, dtype))',
      'w[f"{name}/bias"] = tf.cast(dense.bias, dtype)[:cut(dense.bias).shape[-1]]',  # the first group's, always
      "tests/test_tensor.py -k 'test_the_layers_group_parts_sum and qwen2'"),
    M("hf-qwen2-biases-unmapped", "tpu_llm/model/families/qwen2.py",
      'return [(f"{h}self_attn.{p}_proj.bias", f"{b}attn/{p}/bias", False) for p in ("q", "k", "v")]', "return []",
      "tests/test_hf.py -k 'test_new_families_import and qwen2'"),
    M("hf-sliding-window-unchecked", "tpu_llm/model/families/base.py",
      "if self.window_layers(read) and window < context:", "if False:",
      "tests/test_untrusted_files.py -k test_a_config_json_tpu_llm_cannot_read_is_one_line"),
    # ---- LoRA (issue 41) --------------------------------------------------------------------------------
    M("lora-scale-ignored", "tpu_llm/model/adapters.py",
      "adapter(inputs, self.lora_a, self.lora_b, self.scale)", "adapter(inputs, self.lora_a, self.lora_b, 1.0)",
      "tests/test_lora.py -k test_the_adapter_adds tests/test_lora_peft.py -k test_logits_equal_peft"),
    M("lora-a-drawn-as-keras-he-uniform", "tpu_llm/model/adapters.py",
      "bound = 1.0 / math.sqrt(fan_in)", "bound = math.sqrt(6.0 / fan_in)",
      "tests/test_lora.py -k test_new_adapters_leave_the_model"),
    M("lora-base-left-trainable", "tpu_llm/model/adapters.py",
      "                v.trainable = False\n", "                pass\n",
      "tests/test_lora.py -k 'test_new_adapters_leave_the_model or test_training_moves_only_the_adapters'"),
    M("lora-dropout-also-at-inference", "tpu_llm/model/adapters.py",
      "inputs = self.lora_drop(inputs, training=training)", "inputs = self.lora_drop(inputs, training=True)",
      "tests/test_lora.py -k test_adapter_dropout"),
    M("lora-tensor-group-takes-the-first-columns-of-b", "tpu_llm/model/adapters.py",
      'f"{name}/{ADAPTER_OUT}": columns(b) if columns is not None else b}',
      'f"{name}/{ADAPTER_OUT}": b[:, :columns(b).shape[-1]] if columns is not None else b}',
      "tests/test_lora.py -k 'test_pipeline_stages_and_tensor_groups and llama'"),
    M("lora-tensor-group-takes-the-first-rows-of-a", "tpu_llm/model/adapters.py",
      'return {f"{name}/{ADAPTER_IN}": tf.convert_to_tensor(self.lora_a)[rows],',
      'return {f"{name}/{ADAPTER_IN}": tf.convert_to_tensor(self.lora_a)[:rows.stop - rows.start if rows.stop else None],',
      "tests/test_lora.py -k 'test_pipeline_stages_and_tensor_groups and gpt2-1-4'"),
    M("lora-init-from-leaves-the-base-random", "tpu_llm/training/checkpoint.py",
      "        adapters.copy_base(base, model)\n", "        pass\n",
      "tests/test_lora.py -k test_training_moves_only_the_adapters"),
    M("lora-settings-of-a-run-unchecked", "tpu_llm/training/run_directory.py",
      "model_differences(saved.get(\"model\", {}), cfg.model) + adapter_differences(saved, cfg)",
      "model_differences(saved.get(\"model\", {}), cfg.model)",
      "tests/test_lora.py -k test_a_run_with_other_lora_settings_is_refused"),
    M("lora-export-unmerged", "tpu_llm/interop/export.py",
      "model, cfg.train = model.merged(), cfg.train.without_adapters()",
      "cfg.train = cfg.train.without_adapters()",
      "tests/test_lora_peft.py -k test_export_format_hf_of_a_lora_run"),
    M("peft-export-b-as-a", "tpu_llm/interop/peft.py",
      'tensors[f"{PREFIX}{module}.lora_B.weight"] = layers[path].lora_b',
      'tensors[f"{PREFIX}{module}.lora_B.weight"] = layers[path].lora_b * 0',
      "tests/test_lora_peft.py -k test_an_exported_peft_adapter"),
    M("peft-import-takes-dora", "tpu_llm/interop/peft.py",
      '"use_dora": False, ', "",
      "tests/test_lora_peft.py -k test_an_adapter_that_cannot_be_read_exactly"),
    M("lora-adapted-projection-drops-its-qwen2-bias", "tpu_llm/model/adapters.py",
      "return LoraDense(units, self, **options)", "return LoraDense(units, self, **{**options, 'use_bias': False})",
      "tests/test_lora_peft.py -k 'test_logits_equal_peft and qwen2'"),
    M("notebook-lora-starts-from-random-weights", "notebooks/quickstart.ipynb",
      ' f\\"--train.init_from={BASE_DIR}\\",', "",
      "tests/test_notebook.py -k test_notebook_runs_end_to_end"),
    M("plan-lora-charges-every-parameter", "tpu_llm/tools/plan_memory.py",
      "    if cfg.train.lora_rank:\n        return stage.params\n", "",
      "tests/test_lora.py -k test_the_plan_charges"),
    # a LoRA base stored in bfloat16 or int8 (train.lora_base_dtype, tests/test_lora_base.py)
    M("lora-base-left-float32", "tpu_llm/model/adapters.py",
      'kwargs.update(dtype="bfloat16", trainable=False)', "kwargs.update(trainable=False)",
      "tests/test_lora_base.py -k 'test_the_base_is_stored and bfloat16-gpt2'"),
    M("lora-group-adapter-in-the-compute-dtype", "tpu_llm/model/adapters.py",
      "b = tf.convert_to_tensor(self.lora_b) * self.scale",
      "b = tf.cast(self.lora_b, tf.bfloat16) * self.scale",
      "tests/test_lora.py -k mixed_bfloat16"),
    M("lora-int8-scale-dropped", "tpu_llm/model/adapters.py",
      "        kernel = kernel / tf.convert_to_tensor(dense.kernel_scale)\n", "        pass\n",
      "tests/test_lora_base.py -k 'test_the_base_is_stored and int8-gpt2'"),
    M("lora-int8-group-slice-scale-dropped", "tpu_llm/model/layers.py",
      "kernel = tf.cast(kernel, tf.float32) / cut(tf.convert_to_tensor(dense.kernel_scale))",
      "kernel = tf.cast(kernel, tf.float32)",
      "tests/test_lora_base.py -k 'test_stages_and_groups_give and int8'"),
    M("lora-int8-activations-quantized-too", "tpu_llm/model/adapters.py",
      "Int8QuantizationConfig(activation_quantizer=None)", "Int8QuantizationConfig()",
      "tests/test_lora_base.py -k 'test_the_base_is_stored and int8-gpt2'"),
    M("lora-init-from-casts-into-int8", "tpu_llm/model/adapters.py",
      '        if path + "_scale" in ours:', "        if False:",
      "tests/test_lora_base.py -k 'test_the_base_is_stored and int8-gpt2'"),
    M("lora-base-dtype-of-a-run-unchecked", "tpu_llm/config/checks.py",
      '("lora_rank", "lora_alpha", "lora_targets", "lora_base_dtype")', '("lora_rank", "lora_alpha", "lora_targets")',
      "tests/test_lora_base.py -k 'test_training_moves_only_the_adapters and int8'"),
    M("plan-lora-bfloat16-base-at-4-bytes", "tpu_llm/tools/plan_memory.py",
      "        return full - 2 * elements\n", "        return full\n",
      "tests/test_lora_base.py -k test_the_plan_holds_the_stored_base"),
    # ---- files from outside (issue 28) ----------------------------------------------------------------
    M("safetensors-offsets-past-the-data", "tpu_llm/interop/safetensors_io.py",
      "if not 0 <= begin <= end <= data_size:", "if not 0 <= begin <= end:",
      "tests/test_untrusted_files.py::test_a_damaged_header_is_refused_when_the_reader_is_made_naming_the_file_and_tensor"
      "[offsets-past-the-data]"),
    M("safetensors-overlap-unchecked", "tpu_llm/interop/safetensors_io.py",
      "        if begin < end:\n", "        if False:\n",
      "tests/test_untrusted_files.py::test_a_damaged_header_is_refused_when_the_reader_is_made_naming_the_file_and_tensor"
      "[overlapping-tensors]"),
    M("shard-link-out-of-the-checkpoint", "tpu_llm/interop/safetensors_io.py",
      "if os.path.commonpath([root, real]) != root:", "if False:",
      "tests/test_untrusted_files.py::test_a_shard_that_links_out_of_the_checkpoint_is_refused"),
    M("hf-weight-dtype-unchecked", "tpu_llm/interop/hf.py",
      "if dtype not in WEIGHT_DTYPES:", "if False:",
      "tests/test_untrusted_files.py::test_an_integer_dtype_on_a_weight_is_refused_before_the_model_is_built"),
    M("config-caps-unchecked", "tpu_llm/config/checks.py",
      "    _validate_caps(cfg)  # first", "    pass  # first",
      "tests/test_untrusted_files.py -k test_every_capped_key"),
    # ---- data at pod scale (issue 16) ---------------------------------------------------------------
    M("shards-balanced-by-nothing", "tpu_llm/data/prepare.py",
      "bounds = [(i + 1) * total // num_shards for i in range(num_shards)]",
      "bounds = [total for i in range(num_shards)]",
      "tests/test_data_scale.py::test_one_file_into_8_shards_is_balanced_and_none_is_empty"),
    M("empty-data-guard-never-fires", "tpu_llm/data/lanes.py",
      "tf.debugging.assert_less(empty, tf.cast(n + 1, tf.int64)",
      "tf.debugging.assert_less(tf.constant(0, tf.int64), tf.cast(n + 1, tf.int64)",
      "tests/test_data_scale.py::test_empty_inputs_give_a_one_line_error_not_a_hang"),
    M("pipelines-read-strided-lanes", "tpu_llm/data/lanes.py",
      "first = index * lanes // pipelines if own else 0", "first = index if own else 0",
      "tests/test_data_scale.py::test_resume_on_another_number_of_pipelines_neither_repeats_nor_skips"),
    M("few-lanes", "tpu_llm/data/lanes.py",
      "MAX_LANES = 512", "MAX_LANES = 4",
      "tests/test_data_scale.py::test_batches_of_512_over_64_shards_hold_mostly_distinct_documents"),
    # ---- issue 30: the 13 disagreements between the docs and the program, each reintroduced ----------
    # (their "tests" are the docs checker on the page, or the test that runs the hints as printed)
    M("docs-1-old-unknown-key-text", "docs/quickstart.md",
      "error: tpu-llm train: unknown flag --model.n_layers; did you mean --model.n_layer? see `tpu-llm train --help`",
      "error: unknown config key 'model.n_layers'; did you mean 'model.n_layer'?", "scripts/docs_check.py docs/quickstart.md"),
    M("docs-2-same-thing-without-run-dir", "docs/quickstart.md",
      "--set model.n_layer=6 --set train.steps=1000 --run_dir runs/six", "--set model.n_layer=6 --set train.steps=1000",
      "scripts/docs_check.py docs/quickstart.md"),
    M("docs-3-imported-train-without-config", "docs/tokenizers.md",
      "tpu-llm train --config runs/llama-imported/config.yaml --data.train='shards/*.tfrecord'",
      "tpu-llm train --run_dir runs/llama-imported --data.train='shards/*.tfrecord' --data.tokenizer=hf",
      "scripts/docs_check.py docs/tokenizers.md"),
    M("docs-4-prepare-hint-without-model", "tpu_llm/cli/commands.py",
      'if kind == "sentencepiece":', 'if kind == "sentencepiece-never":',
      "tests/test_dry_run.py::test_prepare_hint_trains_as_printed"),
    M("docs-5-import-hint-with-files", "tpu_llm/cli/commands.py",
      "/config.yaml {train_flags(shards, 'hf')}  (fine-tune)", "/config.yaml --data.train=FILES  (fine-tune)",
      "tests/test_dry_run.py::test_import_hints_run_as_printed"),
    M("docs-6-stale-v5p-16-workspace", "docs/planning.md",
      "  workspace                                        1.2 GiB             3.3 GiB",
      "  workspace                                        1.2 GiB             9.4 GiB", "scripts/docs_check.py docs/planning.md"),
    M("docs-7-stale-v4-8-share", "docs/planning.md",
      "103.5 GiB = 324% of the 32.0 GiB HBM", "103.5 GiB = 400% of the 32.0 GiB HBM", "scripts/docs_check.py docs/planning.md"),
    M("docs-8-stale-pipeline-numbers", "docs/pipeline-tensor.md",
      "blocks 0-1 + embedding; 445,824 params", "blocks 0-1 + embedding; 412,160 params",
      "scripts/docs_check.py docs/pipeline-tensor.md"),
    M("docs-9-table-without-rows", "docs/memory.md",
      "|---|---|---|---|---|---|---|---|---|---|\n| gpt2_125m T=1024 | dense | dense | 0.589",
      "|---|---|---|---|---|---|---|---|---|---|\n\n| gpt2_125m T=1024 | dense | dense | 0.589",
      "scripts/docs_check.py docs/memory.md"),
    M("docs-10-absl-lines-on-stderr", "tpu_llm/cli/__init__.py",
      "        if not verbose:  # absl's INFO lines", "        if False:  # absl's INFO lines",
      "scripts/docs_check.py docs/profiling.md"),
    M("docs-11-hosts-read-other-batches", "tpu_llm/data/lanes.py",
      "order = seed if seed is not None else", "order = seed + index if seed is not None else",
      "scripts/docs_check.py docs/distributed.md"),
    M("docs-12-dry-run-needs-outputs", "tpu_llm/cloud/base.py",
      "            if self.dry and required:", "            if False:", "scripts/docs_check.py docs/cloud-tpu.md"),
    M("docs-13-readme-loss-no-run-gives", "README.md",
      "step  25/500 [#-------------------] loss 4.1898 | lr 1.68e-03", "step  25/500 [#-------------------] loss 4.0712 | lr 1.91e-03",
      "scripts/docs_check.py README.md"),
    # Issue 39: a run that owns its TPU
    M("owner-skips-teardown", "tpu_llm/cloud/run_owner.py",
      "        self.copy_log(force=True)\n        self.teardown()\n", "        self.copy_log(force=True)\n",
      "tests/test_tpu_ownership.py -k deletes_its_tpu"),
    M("launch-never-attaches", "tpu_llm/cloud/worker_plan.py",
      """2>/dev/null)\\" != \\"$key\\" ]; then",""", """2>/dev/null)\\" = \\"$key\\" ]; then",""",
      "tests/test_tpu_ownership.py -k reattaches"),
    M("tpu-down-asks-nobody", "tpu_llm/cloud/provision.py",
      'if flag("FORCE") or not o or not o["tpu_enabled"]', 'if True or not o or not o["tpu_enabled"]',
      "tests/test_tpu_ownership.py -k tpu_down_refuses"),
    M("interrupt-leaves-the-request", "tpu_llm/cloud/provision.py",
      "        except KeyboardInterrupt:\n            self.withdraw_queued(o)\n",
      "        except KeyboardInterrupt:\n            raise\n", "tests/test_tpu_ownership.py -k interrupted"),
    M("replace-without-asking", "tpu_llm/cloud/provision.py",
      "        if changes and not replace:", "        if False:", "tests/test_tpu_ownership.py -k refuses_to_replace"),
    M("pod-runtime-not-restarted", "infra/startup.sh.tftpl",
      "    systemctl restart tpu-runtime\n", "\n", "tests/test_infra.py -k tpu_runtime"),
]

def check(mutations) -> list[str]:
    """Every stale mutation (old text missing or not unique, a test it names missing), in words."""
    problems = []
    for m in mutations:
        text = (REPO / m.file).read_text()
        n = text.count(m.old)
        if n != 1:
            problems.append(f"{m.name}: its old text occurs {n} times in {m.file} (must be once): {m.old[:60]!r}")
    names = [m.name for m in mutations]
    problems += [f"{n}: name used twice" for n in sorted({n for n in names if names.count(n) > 1})]
    return problems + missing_tests(mutations)


@functools.lru_cache(maxsize=None)
def collected_tests(path: Path) -> frozenset[str]:
    """The tests pytest would collect from a file, as node-id tails (`test_x`, `TestY::test_z`), read
    from its source without importing it."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names |= {node.name} | {f"{node.name}::{f.name}" for f in node.body
                                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                                    and f.name.startswith("test")}
    return frozenset(names)


def missing_tests(mutations) -> list[str]:
    """Every test a mutation names that does not exist (a file, a node id, a `-k` word matching no test
    of its files), in words. pytest would only say so when the mutation runs (as an error); a test
    renamed or removed is found here, before anything runs, and by tests/test_mutants.py in CI."""
    problems = []
    for m in mutations:
        files, words, args = [], [], iter(shlex.split(m.tests))
        for arg in args:
            if arg == "-k":
                words.append(next(args, ""))
            elif arg.startswith("-k"):
                words.append(arg[2:])
            elif not arg.startswith("-") and (".py" in arg or "/" in arg):  # (not an option's value: -m slow)
                file, _, node = arg.partition("::")
                if not (REPO / file).exists():
                    problems.append(f"{m.name}: names {file}, which does not exist")
                    continue
                if (REPO / file).is_dir() or not file.endswith(".py") or file.startswith("scripts/"):
                    continue  # (a folder, a docs page, or the docs checker run as a program)
                files.append(file)
                node = re.sub(r"\[.*\]$", "", node)  # a parametrized test's id: the function must exist
                if node and node not in collected_tests(REPO / file):
                    problems.append(f"{m.name}: names {arg}, which is not a test in {file}")
        names = {n for f in files for n in collected_tests(REPO / f)}
        for word in words:  # a plain word (what the list uses) matches names as pytest -k does
            if re.fullmatch(r"\w+", word) and not any(word.lower() in n.lower() for n in names):
                where = ", ".join(dict.fromkeys(files)) or "(no file)"
                problems.append(f"{m.name}: -k {word} matches no test in {where}")
    return problems


def scratch_copy() -> Path:
    """The repository's tracked files (as they are in the work tree) in a new temporary directory."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    root = Path(tempfile.mkdtemp(prefix="mutants-"))
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def run_tests(root: Path, tests: str) -> tuple[str, float, str]:
    """("passed" | "failed" | "error", seconds, last lines of the output)."""
    # no .pyc files: a mutated module rewritten within the same second must not be read from a stale one
    env = {**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *shlex.split(tests)]
    if tests.startswith("scripts/"):  # a checker run as a program (the docs checker): exit 1 when it finds a fault
        cmd = [sys.executable, *shlex.split(tests)]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        return "failed", time.monotonic() - start, f"timed out after {TIMEOUT} s"
    seconds = time.monotonic() - start
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    tail = "\n".join([line for line in lines if line.startswith("E ")][:3] + lines[-2:])
    # pytest: 0 all passed, 1 some failed, 5 nothing collected; 2-4 usage or internal errors
    return {0: "passed", 1: "failed"}.get(proc.returncode, "error"), seconds, tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", action="append", default=[], help="run mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="print the mutations and their tests")
    parser.add_argument("--check", action="store_true", help="only check that every mutation still applies")
    parser.add_argument("--baseline", action="store_true", help="run each mutation's tests unmutated first")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the last lines of pytest's output")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    problems = check(MUTATIONS)
    if problems:
        print("error: stale mutations in scripts/mutants.py (the code or the tests changed: update or remove them):",
              *problems, sep="\n  ", file=sys.stderr)
        return 2
    if args.list or args.check:
        if args.list:
            for m in chosen:
                print(f"{m.name:45} {m.file:22} {m.tests}")
        print(f"{len(MUTATIONS)} mutations, each old text found once, each test named found")
        return 0
    if not chosen:
        print(f"error: no mutation name contains {' or '.join(args.k)} (see --list)", file=sys.stderr)
        return 2
    root = scratch_copy()
    rows, errors = [], 0
    width = max(len(m.name) for m in chosen)
    print(f"{'mutation':{width}}  {'result':8}  {'seconds':>7}  tests", flush=True)
    try:
        for m in chosen:
            if args.baseline:
                result, _, tail = run_tests(root, m.tests)
                if result != "passed":
                    print(f"{m.name:{width}}  {'error':8}  {'':>7}  unmutated tests do not pass: {tail}", flush=True)
                    errors += 1
                    continue
            path = root / m.file
            original = path.read_text()
            path.write_text(original.replace(m.old, m.new, 1))
            try:
                result, seconds, tail = run_tests(root, m.tests)
            finally:
                path.write_text(original)
            verdict = {"failed": "killed", "passed": "SURVIVED", "error": "error"}[result]
            rows.append((m, verdict, seconds))
            errors += verdict == "error"
            print(f"{m.name:{width}}  {verdict:8}  {seconds:7.1f}  {m.tests}", flush=True)
            if verdict == "error" or args.verbose:
                print("\n".join(f"{'':{width}}  {line}" for line in tail.splitlines()), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    killed = sum(v == "killed" for _, v, _ in rows)
    survived = sum(v == "SURVIVED" for _, v, _ in rows)
    total = sum(s for _, _, s in rows)
    print(f"{killed} killed, {survived} survived" + (f", {errors} error(s)" if errors else "") +
          f" ({total:.0f} s)")
    return 1 if survived else 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
