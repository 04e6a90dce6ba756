"""Process and platform helpers anyone may import: files (regular files only, atomic writes, local or gs://),
the run directory's layout (run_layout.py), TensorFlow and Keras behaviour no public API gives (tf_compat.py),
XLA's dump flags (xla_flags.py), TPU generations and their runtime (tpu_chips.py), peak FLOP/s and MFU
(peak.py, perf.py), native log lines silenced at their source (native_log.py), and child processes tied to
their parent's life (tether.py). None of them imports another part of tpu_llm but errors.py and these."""
