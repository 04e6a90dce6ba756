"""The offline compile harness: a run's real step, built by the run assembler (training/assemble.py), traced
and compiled without the hardware it targets. offline_tpu.py lays it out on an offline TPUStrategy (a
hand-built topology), compiled_step.py compiles its replica computation as TF's TPU rewrite would hand it
to XLA, placement_audit.py reads which core runs what from the compiled HLO (`tpu-llm bench placement`,
doctor's hlo lines), and xla_memory.py reads XLA:CPU's buffer assignment of the step (`tpu-llm bench
memory`, the planner's tests). User commands live in tpu_llm/tools/, which calls these."""
